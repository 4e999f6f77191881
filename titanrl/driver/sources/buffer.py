"""The trajectory buffer of a continuous run: which groups may be generated now, which ones a step trains.

Groups are numbered in the order their prompts leave the data stream; with P =
`rollout.prompts_per_step`, group g is trained by step `g // P + 1`, together with the other
groups of that step, whatever order the workers finish them in.

Admission control: the groups of step s are admitted (handed to the workers) once the trainer
has completed step `s - 1 - max_staleness`, and must start from the weights of that step or
newer (`GroupTask.min_version`). They are trained after step s - 1, so the weights that sampled
any of their tokens are at most `max_staleness` versions older than the trainer's (fewer when a
step was skipped: a skipped step does not advance the version). In-flight weight updates only
make tokens newer. So no finished group is ever thrown away for being stale, and
`max_staleness=0` is synchronous on-policy GRPO: step s's groups start after step s - 1's weights.

Pure bookkeeping, no Ray: `titanrl.driver.sources.continuous` moves the tasks to and from the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from titanrl.data import PromptStream
from titanrl.types import Group


@dataclass
class GroupTask:
    """One prompt group to generate."""

    group_id: int
    """Position of its prompt in the run's data stream (0-based)."""
    row: dict[str, Any]
    """The dataset row."""
    seed: int
    """Seed of its first sample (`titanrl.rollout.seeds.request_seed` with this group first)."""
    step: int
    """The training step that consumes it."""
    min_version: int
    """Oldest weights it may start from: the trainer's version when it was admitted."""
    attempts: int = 0
    """Times it was handed to a worker (more than 1 after a worker died running it)."""


@dataclass
class BufferState:
    """A checkpoint of the buffer (plain data, no Ray objects)."""

    tasks: list[tuple[GroupTask, Group | None]]
    """Admitted groups no step has trained yet, with their results where finished."""
    next_step: int
    """First step whose groups are not admitted yet."""
    stream_state: dict[str, Any]
    """Data-stream position before that step's prompts are drawn."""

    @property
    def exact(self) -> bool:
        """False when some admitted group had not finished: a resume generates it again, from newer weights."""
        return all(group is not None for _, group in self.tasks)


class TrajectoryBuffer:
    """Admits groups, collects finished ones and hands each step its groups."""

    def __init__(
        self,
        stream: PromptStream,
        prompts_per_step: int,
        max_staleness: int,
        total_steps: int,
        seed_of_group: Callable[[int], int],
    ) -> None:
        self.stream, self.prompts_per_step = stream, prompts_per_step
        self.max_staleness, self.total_steps, self.seed_of_group = max_staleness, total_steps, seed_of_group
        self.tasks: dict[int, GroupTask] = {}
        """Admitted, not yet trained, by group id."""
        self.finished: dict[int, Group] = {}
        """Results of admitted groups, by group id."""
        self.next_step = 1

    # ------------------------------------------------------------------ admission

    def admit(self, completed_steps: int, version: int) -> list[GroupTask]:
        """New tasks allowed now that `completed_steps` steps are done and the trainer is at `version`."""
        last = min(completed_steps + 1 + self.max_staleness, self.total_steps)
        new: list[GroupTask] = []
        while self.next_step <= last:
            first = (self.next_step - 1) * self.prompts_per_step
            for j, row in enumerate(self.stream.next_batch()):
                task = GroupTask(first + j, row, self.seed_of_group(first + j), self.next_step, version)
                self.tasks[task.group_id] = task
                new.append(task)
            self.next_step += 1
        return new

    def retry(self, group_id: int, version: int) -> GroupTask:
        """The same group again (its worker died), from the current weights."""
        task = self.tasks[group_id]
        if group_id in self.finished:
            raise ValueError(f"group {group_id} already finished; it is not generated twice")
        task.min_version = max(task.min_version, version)
        return task

    # ------------------------------------------------------------------ results

    def finish(self, group_id: int, group: Group) -> None:
        """Records a finished group; a group that is unknown or already finished is an error."""
        if group_id not in self.tasks:
            raise KeyError(f"group {group_id} was not admitted (or was already trained)")
        if group_id in self.finished:
            raise ValueError(f"group {group_id} finished twice")
        self.finished[group_id] = group

    def unfinished(self) -> list[GroupTask]:
        """Admitted groups without a result, oldest first."""
        return [t for gid, t in sorted(self.tasks.items()) if gid not in self.finished]

    def step_group_ids(self, step: int) -> range:
        return range((step - 1) * self.prompts_per_step, step * self.prompts_per_step)

    def ready(self, step: int) -> bool:
        """Whether every group of `step` has finished."""
        return all(gid in self.finished for gid in self.step_group_ids(step))

    def take(self, step: int) -> list[Group]:
        """Removes and returns the groups of `step`, in group-id order; they must all have finished."""
        ids = self.step_group_ids(step)
        missing = [gid for gid in ids if gid not in self.finished]
        if missing:
            raise RuntimeError(f"step {step} is not ready: groups {missing[:5]} have not finished")
        groups = [self.finished.pop(gid) for gid in ids]
        for gid in ids:
            del self.tasks[gid]
        return groups

    @property
    def groups_waiting(self) -> int:
        """Finished groups no step has trained yet."""
        return len(self.finished)

    @property
    def in_flight(self) -> int:
        return len(self.tasks) - len(self.finished)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> BufferState:
        """What a checkpoint stores: admitted tasks (finished ones with their results) and the stream position.

        Unfinished groups are generated again after a resume, from the weights of then.
        """
        tasks = [(task, self.finished.get(gid)) for gid, task in sorted(self.tasks.items())]
        return BufferState(tasks, self.next_step, self.stream.state_dict())

    def load_state_dict(self, state: BufferState) -> None:
        self.tasks = {task.group_id: task for task, _ in state.tasks}
        self.finished = {task.group_id: group for task, group in state.tasks if group is not None}
        self.next_step = state.next_step
        self.stream.load_state_dict(state.stream_state)
