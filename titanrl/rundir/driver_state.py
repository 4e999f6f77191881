"""`driver.pt` of a training checkpoint: the driver's side of the run state, as plain data.

    {"format_version": 1, "step": int, "policy_version": int, "exact": bool,
     "rollouts": <the rollout source's checkpoint, `titanrl.rundir.plain.to_plain`>,
     "rng": <torch / python / numpy RNG states, `titanrl.trainer.checkpoint.rng_state`>}

Only dicts, lists, tuples, strings, numbers, None and tensors: it is read with
`torch.load(weights_only=True)`, so no Python class is named in the file and moving one
breaks no saved run. Format 0 (before the version field) pickled the dataclasses themselves;
it is refused with a message saying so.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from titanrl.rundir.checkpoints import RunCheckpointError

DRIVER_STATE = "driver.pt"
FORMAT_VERSION = 1
"""Bumped whenever the layout above changes in a way older readers would misread."""


def write_driver_state(path: Path, state: dict[str, Any]) -> None:
    """Writes `state` (plain data, the keys above but `format_version`) to `path`."""
    torch.save({"format_version": FORMAT_VERSION, **state}, path)


def read_driver_state(checkpoint_dir: Path) -> dict[str, Any]:
    """The driver state of a checkpoint, or a `RunCheckpointError` saying which format it has and what to do."""
    path = Path(checkpoint_dir) / DRIVER_STATE
    if not path.is_file():
        raise RunCheckpointError(f"{str(path)!r} is missing: the checkpoint is incomplete; start a new run")
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        # Format 0 pickled titanrl's own classes, which a weights_only load refuses by design.
        raise RunCheckpointError(
            f"{str(path)!r}: this run was saved by an older TitanRL (driver.pt format 0, pickled Python "
            f"classes; this TitanRL reads format {FORMAT_VERSION}); resume it with that version or start a new run"
        ) from e
    found = state.get("format_version", 0) if isinstance(state, dict) else 0  # format 0 had no version
    if found != FORMAT_VERSION:
        older = isinstance(found, int) and found < FORMAT_VERSION
        raise RunCheckpointError(
            f"{str(path)!r}: this run was saved by {'an older' if older else 'another'} TitanRL (driver.pt "
            f"format {found}; this TitanRL reads format {FORMAT_VERSION}); resume it with that version or start "
            "a new run"
        )
    return state
