"""Sampling seeds: one distinct seed for every (group, sample, turn) of a run.

Every generated sample draws its randomness from its own seed, so a run is reproducible and
no two samples share a random stream, whichever worker or request they land in. A run's
seeds are laid out on one line, a "slot" per model turn:

    slot(group g, sample i, turn t) = (g * group_size + i) * max_turns + t
    seed = run_base(run_seed) + slot

Group ids are handed out consecutively by the driver, so a request whose first group is
`first_group_id` owns the contiguous slots starting at `first_group_id * group_size *
max_turns`. Inside a request:

- single-turn (max_turns = 1): `VllmEngine.generate` gives prompt j seed `seed + j*n`, and
  vLLM gives sample i of it `+ i`, i.e. `seed + j*n + i`;
- episodes: sample (j, i) starts at `episode_seed(seed, j*n + i, max_turns)` and turn t adds t.

Both give exactly the slot formula above. Seeds stay non-negative and below 2**63 (vLLM seeds
torch generators with them).
"""

from __future__ import annotations

SLOT_BITS = 42
"""Slots per run: 2**42 (4.4e12) sample-turns, e.g. 1M steps x 1024 prompts x 64 samples x 64 turns."""
RUN_SEED_BITS = 20
"""Run seeds are taken modulo 2**20; two runs whose seeds differ by a multiple of it share streams."""


def run_base(run_seed: int) -> int:
    """First seed of a run (slot 0)."""
    _check_int("run_seed", run_seed)
    return (run_seed % (1 << RUN_SEED_BITS)) << SLOT_BITS


def request_seed(run_seed: int, first_group_id: int, group_size: int, max_turns: int = 1) -> int:
    """The `seed` argument of `RolloutWorker.generate` for a request whose first group is `first_group_id`.

    `max_turns` is `env.max_turns` for episode rollouts and 1 for single-turn ones; it must be
    the same for every request of a run (so must `group_size`).
    """
    _check_int("first_group_id", first_group_id, minimum=0)
    _check_int("group_size", group_size, minimum=1)
    _check_int("max_turns", max_turns, minimum=1)
    slot = first_group_id * group_size * max_turns
    if slot >= 1 << SLOT_BITS:
        raise ValueError(
            f"request_seed: group {first_group_id} x group_size {group_size} x max_turns {max_turns} "
            f"exceeds the 2**{SLOT_BITS} seeds of a run"
        )
    return run_base(run_seed) + slot


def episode_seed(request_seed: int, sample_index: int, max_turns: int) -> int:
    """Seed of turn 0 of the request's `sample_index`-th episode (j * group_size + i); turn t adds t."""
    return request_seed + sample_index * max_turns


def sample_seed(run_seed: int, group_id: int, sample_index: int, group_size: int, max_turns: int = 1,
                turn: int = 0) -> int:
    """The seed that sample `sample_index` of group `group_id` uses at `turn` (the layout above)."""
    if not 0 <= sample_index < group_size or not 0 <= turn < max_turns:
        raise ValueError(f"sample_index must be in [0, {group_size}) and turn in [0, {max_turns})")
    return request_seed(run_seed, group_id, group_size, max_turns) + sample_index * max_turns + turn


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
