"""Generation requests in flight: what was asked of the workers, by which policy, and how to resume it.

Request r (0-based) feeds training step r + 1. The driver keeps up to `1 + max_staleness`
requests queued; each is split over the workers by prompt, and its groups get consecutive
group ids and a seed block of their own (`titanrl.rollout.seeds.request_seed`), so a request
is a pure function of (data-stream position, group ids, policy weights).

That makes the queue checkpointable: a request issued with the trainer's current weights can
be issued again after a restart and yields the same samples, so the checkpoint only records
where the data stream stood before it. A request issued with an older policy cannot be
regenerated (those weights no longer exist), so its finished results are stored.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from titanrl.data import PromptStream
from titanrl.driver.sources.base import RolloutSource
from titanrl.rollout.seeds import request_seed
from titanrl.types import RolloutBatch, StepRollouts
from titanrl.weight_sync import WeightPush, WeightSync


@dataclass
class Request:
    """One generation request, split over the workers."""

    index: int
    """0-based request number; it feeds training step index + 1."""
    first_group_id: int
    """Group id of its first prompt."""
    policy_version: int
    """Trainer version whose weights the workers hold when they run it."""
    stream_state: dict[str, Any]
    """Data-stream position before its prompts were drawn (to issue it again)."""
    refs: list[Any] = field(default_factory=list)
    """Ray object refs of the per-worker RolloutBatch results."""


@dataclass
class QueueCheckpoint:
    """What a checkpoint stores of the queue (picklable, no Ray objects)."""

    finished: list[tuple[Request, list[RolloutBatch]]]
    """Requests made by older policies (without refs) and their results, oldest first."""
    next_index: int
    """Index of the first request to issue after the stored ones."""
    next_group_id: int
    """Its first group id."""
    stream_state: dict[str, Any]
    """Data-stream position before its prompts are drawn."""
    exact: bool
    """False when results of an older policy were lost (a crash) and will be regenerated instead."""


class RequestQueue:
    """Issues generation requests to the workers and hands their results back in order."""

    def __init__(self, workers: list[Any], stream: PromptStream, run_seed: int, group_size: int, turns_per_sample: int):
        self.workers, self.stream = workers, stream
        self.run_seed, self.group_size, self.turns_per_sample = run_seed, group_size, turns_per_sample
        self.pending: deque[Request] = deque()
        self.next_index = 0
        self.next_group_id = 0

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, policy_version: int) -> None:
        """Queues the next request behind everything already queued on each worker."""
        state = self.stream.state_dict()
        rows = self.stream.next_batch()
        request = Request(self.next_index, self.next_group_id, policy_version, state)
        n = len(self.workers)
        for i, worker in enumerate(self.workers):
            chunk = rows[i::n]
            if chunk:
                first = self.next_group_id
                seed = request_seed(self.run_seed, first, self.group_size, self.turns_per_sample)
                request.refs.append(worker.generate.remote(chunk, seed, first))
                self.next_group_id += len(chunk)
        self.next_index += 1
        self.pending.append(request)

    def peek(self, timeout: float | None = None) -> tuple[Request, list[RolloutBatch]]:
        """Waits for the oldest request's results without removing it."""
        import ray

        request = self.pending[0]
        return request, ray.get(request.refs, timeout=timeout)

    def pop(self) -> Request:
        return self.pending.popleft()

    def checkpoint(self, trainer_version: int, wait_s: float | None = None, drop_first: bool = False) -> QueueCheckpoint:
        """Stores results of requests made by older policies; the rest are re-issued on resume.

        `drop_first` leaves the oldest request out even if it is finished (it is issued again
        on resume), e.g. when its rewards were broken. `wait_s` bounds the wait for results
        (a crash may have killed the workers); a request whose results cannot be fetched is
        re-issued with the current policy, and the checkpoint is then marked inexact.
        """
        import ray

        finished: list[tuple[Request, list[RolloutBatch]]] = []
        exact = True
        rewind: Request | None = None
        for position, request in enumerate(self.pending):
            if request.policy_version >= trainer_version:
                rewind = request
                break
            if position == 0 and drop_first:
                rewind, exact = request, False
                break
            try:
                results = ray.get(request.refs, timeout=wait_s)
                finished.append((dataclasses.replace(request, refs=[]), results))
            except Exception:
                rewind, exact = request, False
                break
        if rewind is None:
            return QueueCheckpoint(finished, self.next_index, self.next_group_id, self.stream.state_dict(), exact)
        return QueueCheckpoint(finished, rewind.index, rewind.first_group_id, rewind.stream_state, exact)

    def restore(self, saved: QueueCheckpoint) -> None:
        """Puts stored results back at the head of the queue and rewinds the stream behind them."""
        import ray

        self.pending.clear()
        for request, results in saved.finished:
            self.pending.append(dataclasses.replace(request, refs=[ray.put(batch) for batch in results]))
        self.next_index, self.next_group_id = saved.next_index, saved.next_group_id
        self.stream.load_state_dict(saved.stream_state)


class LockstepRollouts(RolloutSource):
    """The rollout side of a lock-step run, as the GRPO loop sees it (a `RolloutSource`).

    `1 + train.max_staleness` requests stay queued. Each step trains on the oldest one; the new
    weights are queued to every worker behind the requests already there (Ray runs an actor's
    calls in order, so a request never mixes two policy versions).
    """

    checkpoint_type = QueueCheckpoint

    def __init__(self, workers: list[Any], stream: PromptStream, run_seed: int, group_size: int,
                 turns_per_sample: int, max_staleness: int, steps: int) -> None:
        self.workers = workers
        self.queue = RequestQueue(workers, stream, run_seed, group_size, turns_per_sample)
        self.max_staleness, self.steps = max_staleness, steps

    def fill(self, completed_steps: int, version: int) -> None:
        while len(self.queue) < 1 + self.max_staleness and self.queue.next_index < self.steps:
            self.queue.submit(version)

    def next_step(self, step: int) -> StepRollouts:
        request, batches = self.queue.peek()
        if request.index != step - 1:
            raise RuntimeError(f"the oldest queued request feeds step {request.index + 1}, not step {step}")
        return StepRollouts(
            [g for b in batches for g in b.groups],
            sum(b.gen_tokens for b in batches),
            max(b.gen_seconds for b in batches),
            # Summed over the step's requests (workers score in parallel, so it can exceed gen_s).
            sum(b.reward_seconds for b in batches),
        )

    def trained(self, step: int) -> None:
        self.queue.pop()

    def open_weight_sync(self, trainer: Any, transport: str, **plan_options: Any) -> None:
        """Connects the trainer to every worker with `rollout.weight_transport`; `plan_options` are
        WeightSyncPlan fields (e.g. the broadcast's `backend`)."""
        self.sync = WeightSync.open(trainer, self.workers, transport, **plan_options)

    def publish(self, version: int) -> WeightPush:
        """Sends the trainer's weights as `version`; each worker loads them behind its queued requests."""
        return self.sync.push(version)

    def evaluate(self, rows: list[dict[str, Any]], max_tokens: int, threshold: float, version: int) -> dict[str, Any]:
        import ray

        return ray.get(self.workers[0].evaluate.remote(rows, max_tokens, threshold))

    def checkpoint(self, version: int, wait_s: float | None = None, drop_first: bool = False) -> QueueCheckpoint:
        return self.queue.checkpoint(version, wait_s=wait_s, drop_first=drop_first)

    def restore(self, state: QueueCheckpoint, version: int) -> None:
        self.queue.restore(state)

    def has_untrained(self) -> bool:
        return len(self.queue) > 0

    def close(self) -> None:
        """Closes the weight transport (shared memory, broadcast group); the actors stay up."""
        if getattr(self, "sync", None) is not None:
            self.sync.close()
