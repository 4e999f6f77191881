"""What the GRPO loop and the driver ask of a rollout source, whichever kind it is.

Two sources implement `RolloutSource`: `LockstepRollouts` (`lockstep`: one fixed batch per
worker per step, `1 + max_staleness` requests queued, reproducible to the bit) and
`ContinuousRollouts` (`continuous`: group by group into the trajectory buffer, weights taken
between engine steps). `rollout.continuous` picks one (`titanrl.driver.actors.start_rollouts`).

A step's life, as the loop drives it: `fill` queues or admits what the staleness bound allows,
`next_step` waits for the step's groups, the trainer trains on them, `trained` lets them go,
`publish` sends the new weights. `checkpoint` / `restore` carry what is in flight across a
restart. Both keep their actors in a `WorkerPool` (`sources.workers`): a worker that dies is
replaced mid-run, whatever the weight transport.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from titanrl.errors import RunStopped

if TYPE_CHECKING:
    from titanrl.types import StepRollouts
    from titanrl.weight_sync import WeightPush


class RolloutWorkersFailed(RunStopped):
    """A rollout worker died and cannot be replaced (again: `WorkerPool.max_deaths_in_a_row`); the loop
    saves and stops."""


class SourceCheckpoint(Protocol):
    """What a source's `checkpoint` returns: a dataclass of plain data (no Ray objects), which
    the loop stores with `titanrl.rundir.plain.to_plain` and rebuilds as `checkpoint_type`."""

    @property
    def exact(self) -> bool:
        """False when some rollouts in flight were lost and a resume generates them again."""
        ...


class RolloutSource(Protocol):
    """The rollout side of a run, as the GRPO loop (`titanrl.driver.loop`) and the driver see it."""

    workers: list[Any]
    """The rollout worker actors (Ray handles), worker i at index i; a replaced worker's new
    actor takes its place."""
    checkpoint_type: type
    """The dataclass `checkpoint` returns and `restore` takes (rebuilt from the plain data on disk)."""

    def fill(self, completed_steps: int, version: int) -> None:
        """Queues (or admits and dispatches) everything the staleness bound allows once
        `completed_steps` steps are done and the trainer holds policy `version`."""
        ...

    def next_step(self, step: int) -> StepRollouts:
        """Waits for `step`'s groups; they stay owned by the source until `trained(step)`."""
        ...

    def trained(self, step: int) -> None:
        """`step` was trained on: its groups are released."""
        ...

    def open_weight_sync(self, trainer: Any, transport: str, **plan_options: Any) -> None:
        """Connects the trainer to every worker with `rollout.weight_transport`; `plan_options`
        are `WeightSyncPlan` fields (`backend="nccl"`, `host=...`) passed to `WeightSync.open`
        (and again when a replaced worker re-forms the transport)."""
        ...

    def publish(self, version: int) -> WeightPush:
        """Sends the trainer's weights to the workers as `version`."""
        ...

    def evaluate(self, rows: list[dict[str, Any]], max_tokens: int, threshold: float,
                 version: int) -> dict[str, Any]:
        """Greedy evaluation of `rows` with policy `version`: {'correct', 'rewards', 'policy_version'}."""
        ...

    def checkpoint(self, version: int, wait_s: float | None = None, drop_first: bool = False) -> SourceCheckpoint:
        """What a checkpoint keeps of the rollouts in flight; `drop_first` leaves the oldest
        untrained step's rollouts out (they are generated again on resume), `wait_s` bounds the
        wait for results."""
        ...

    def restore(self, state: Any, version: int) -> None:
        """Continues from `checkpoint`'s state, the trainer holding policy `version`."""
        ...

    def has_untrained(self) -> bool:
        """Whether any rollouts are queued or held that no step has trained on."""
        ...

    def close(self) -> None:
        """Closes the weight transport (shared memory, broadcast group); the actors stay up."""
        ...
