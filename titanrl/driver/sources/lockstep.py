"""Generation requests in flight: what was asked of the workers, by which policy, and how to resume it.

Request r (0-based) feeds training step r + 1. The driver keeps up to `1 + max_staleness`
requests queued; each is split over the workers by prompt, and its groups get consecutive
group ids and a seed block of their own (`titanrl.rollout.seeds.request_seed`), so a request
is a pure function of (data-stream position, group ids, policy weights).

That makes the queue checkpointable: a request issued with the trainer's current weights can
be issued again after a restart and yields the same samples, so the checkpoint only records
where the data stream stood before it. A request issued with an older policy cannot be
regenerated (those weights no longer exist), so its finished results are stored.

The same purity makes a worker's death survivable (`titanrl.driver.sources.workers`): the
replacement loads the trainer's current weights and is handed the dead worker's part of every
queued request, same rows, seeds and group ids. A part issued with the current weights (every
part, with max_staleness=0) yields the very samples the dead worker would have; one issued with
an older policy is generated from the current weights instead (fresher, not the same bits).

Dynamic sampling (`rollout.shaping.dynamic_sampling`, `sources.dynamic_sampling`) asks for extra
requests of fresh prompts while a step waits for its rollouts, with the current weights. They draw
from the stream after every queued request and before the next one is queued, so a queued
request's recorded stream position stays right, and a resume draws them again in the same order.
With max_staleness > 0 an extra request waits on each worker behind the requests queued there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from collections.abc import Callable

from titanrl.data import PromptStream
from titanrl.driver.sources.base import RolloutSource
from titanrl.driver.sources.dynamic_sampling import informative_groups
from titanrl.driver.sources.workers import MAX_DEATHS_IN_A_ROW, WorkerPool
from titanrl.rollout.seeds import request_seed
from titanrl.types import Group, RolloutBatch, StepRollouts
from titanrl.weight_sync import WeightPush

log = logging.getLogger("titanrl")

MAX_ATTEMPTS = 8
"""A request part generated this many times with the wrong weights is an error, not bad luck."""


@dataclass
class RequestPart:
    """What one worker was asked for one request (to ask it again of a replacement)."""

    slot: int
    """The worker slot it went to."""
    actor: Any
    """The actor that runs it (a replacement of the slot gets the part again)."""
    rows: list[dict[str, Any]]
    """Its prompts."""
    seed: int
    """`request_seed` of its first group."""
    first_group_id: int
    """Group id of its first prompt."""
    version: int
    """The policy version its worker holds when it runs it."""
    attempts: int = 1
    """Times it was issued (more than 1 after its worker died, or ran it with other weights)."""


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
    parts: list[RequestPart] = field(default_factory=list)
    """What each ref was asked of which worker (empty for results restored from a checkpoint)."""


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

    def __init__(self, pool: WorkerPool, stream: PromptStream, run_seed: int, group_size: int, turns_per_sample: int):
        self.pool, self.stream = pool, stream
        self.run_seed, self.group_size, self.turns_per_sample = run_seed, group_size, turns_per_sample
        self.pending: deque[Request] = deque()
        self.extras: list[Request] = []
        """Dynamic sampling's extra requests being waited for (handed over too when a worker dies)."""
        self.next_index = 0
        self.next_group_id = 0

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, policy_version: int) -> None:
        """Queues the next request behind everything already queued on each worker."""
        self.pending.append(self._issue(self.next_index, policy_version))
        self.next_index += 1

    def extra(self, index: int) -> list[RolloutBatch]:
        """Dynamic sampling: a request of fresh prompts for request `index`'s step, outside the
        queue, with the newest pushed weights, waited for. Its prompts and group ids come after
        everything drawn so far; the queue's checkpoint keeps no trace of it (a resume that
        generates request `index` again asks for its extra requests again)."""
        request = self._issue(index, self.pool.version)
        self.extras.append(request)
        try:
            return self._results(request)
        finally:
            self.extras.remove(request)

    def _issue(self, index: int, policy_version: int) -> Request:
        """Draws the next prompts and splits them over the workers, each part behind what is queued on it."""
        state = self.stream.state_dict()
        rows = self.stream.next_batch()
        request = Request(index, self.next_group_id, policy_version, state)
        n = len(self.pool.workers)
        for i, worker in enumerate(self.pool.workers):
            chunk = rows[i::n]
            if chunk:
                first = self.next_group_id
                seed = request_seed(self.run_seed, first, self.group_size, self.turns_per_sample)
                part = RequestPart(i, worker, chunk, seed, first, policy_version)
                request.refs.append(worker.generate.remote(chunk, seed, first))
                request.parts.append(part)
                self.next_group_id += len(chunk)
        return request

    def peek(self) -> tuple[Request, list[RolloutBatch]]:
        """Waits for the oldest request's results without removing it (see `_results`)."""
        request = self.pending[0]
        return request, self._results(request)

    def _results(self, request: Request) -> list[RolloutBatch]:
        """Waits for `request`'s results; a part whose worker died is generated again by the
        replacement, a part run with other weights than it was issued for (its worker missed a
        push) again by its worker, now holding the current ones."""
        import ray
        from ray.exceptions import RayActorError

        results: list[RolloutBatch] = []
        for k in range(len(request.refs)):
            while True:
                try:
                    batch = ray.get(request.refs[k])
                except RayActorError as e:
                    part = request.parts[k]
                    self.pool.replace(part.slot, part.actor, e)  # unless it was replaced already
                    self._hand_over(part.slot)
                    continue
                if not request.parts:
                    break  # restored from a checkpoint
                part = request.parts[k]
                if batch.policy_version == part.version:
                    self.pool.served(part.slot)
                    break
                if part.attempts >= MAX_ATTEMPTS:
                    raise RuntimeError(f"rollout worker {part.slot} keeps generating groups {part.first_group_id}+ "
                                       f"with policy {batch.policy_version} instead of {part.version}: its weight "
                                       "pushes are not landing (see its log)")
                log.info(f"rollout worker {part.slot} ran groups {part.first_group_id}+ with policy "
                         f"{batch.policy_version}, not {part.version} (a push it missed); generating them again")
                # Loaded first: the push it missed is not sent again (with a broadcast whose dead
                # member is not replaced yet, no push would reach it), so reissuing alone repeats it.
                self.pool.reload(part.slot)
                self._reissue(request, k)
            results.append(batch)
        return results

    def _hand_over(self, slot: int) -> None:
        """Gives slot's new actor the parts of every queued request that its dead actor had not
        finished, in queue order."""
        import ray

        actor = self.pool.workers[slot]
        for request in [*self.pending, *self.extras]:
            for k, part in enumerate(request.parts):
                if part.slot != slot or part.actor is actor:
                    continue
                ready, _ = ray.wait([request.refs[k]], timeout=0)
                if ready:
                    try:
                        ray.get(ready[0])
                        continue  # finished before the death: its result is kept
                    except Exception:
                        pass
                self._reissue(request, k)

    def _reissue(self, request: Request, k: int) -> None:
        """Part k of `request` again, same rows and seeds, on its slot's current actor and weights."""
        old = request.parts[k]
        if old.version != self.pool.version:
            log.info(f"groups {old.first_group_id}+ of request {request.index} were issued with policy {old.version}, "
                     f"which is gone: they are generated from policy {self.pool.version}")
        actor = self.pool.workers[old.slot]
        request.parts[k] = dataclasses.replace(old, actor=actor, version=self.pool.version, attempts=old.attempts + 1)
        request.refs[k] = actor.generate.remote(old.rows, old.seed, old.first_group_id)

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
                finished.append((dataclasses.replace(request, refs=[], parts=[]), results))
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

    def __init__(self, make_worker: Callable[[int], Any], num_workers: int, stream: PromptStream, run_seed: int,
                 group_size: int, turns_per_sample: int, max_staleness: int, steps: int,
                 max_deaths_in_a_row: int = MAX_DEATHS_IN_A_ROW, dynamic_sampling_max_requests: int = 0) -> None:
        """`make_worker(i)` starts the actor of worker slot i (a `RolloutWorker`), again for a
        replacement; see `WorkerPool` for `max_deaths_in_a_row`. `dynamic_sampling_max_requests`
        > 0 turns on dynamic sampling (`sources.dynamic_sampling`) with that bound."""
        self.pool = WorkerPool(make_worker, num_workers, max_deaths_in_a_row)
        self.queue = RequestQueue(self.pool, stream, run_seed, group_size, turns_per_sample)
        self.max_staleness, self.steps = max_staleness, steps
        self.dynamic_sampling_max_requests = dynamic_sampling_max_requests

    @property
    def workers(self) -> list[Any]:
        return self.pool.workers

    def fill(self, completed_steps: int, version: int) -> None:
        while len(self.queue) < 1 + self.max_staleness and self.queue.next_index < self.steps:
            self.queue.submit(version)

    def next_step(self, step: int) -> StepRollouts:
        request, batches = self.queue.peek()
        if request.index != step - 1:
            raise RuntimeError(f"the oldest queued request feeds step {request.index + 1}, not step {step}")
        groups = [g for b in batches for g in b.groups]
        gen_seconds = max(b.gen_seconds for b in batches)
        metrics: dict[str, float] = {}
        if self.dynamic_sampling_max_requests > 0:
            every = list(batches)

            def more() -> list[Group]:
                nonlocal gen_seconds
                extra = self.queue.extra(request.index)
                every.extend(extra)
                gen_seconds += max(b.gen_seconds for b in extra)  # after the step's own request
                return [g for b in extra for g in b.groups]

            groups, metrics = informative_groups(groups, more, self.dynamic_sampling_max_requests)
            batches = every
        return StepRollouts(
            groups,
            sum(b.gen_tokens for b in batches),  # extra requests' tokens too: they were generated
            gen_seconds,
            # Summed over the step's requests (workers score in parallel, so it can exceed gen_s).
            sum(b.reward_seconds for b in batches),
            {"workers/restarts": float(self.pool.restarts),
             "memory/worker_peak_gib": max(b.peak_rss_gib for b in batches), **metrics},
        )

    def trained(self, step: int) -> None:
        self.queue.pop()

    def open_weight_sync(self, trainer: Any, transport: str, **plan_options: Any) -> None:
        """Connects the trainer to every worker with `rollout.weight_transport`; `plan_options`
        are WeightSyncPlan fields (backend, host, ...)."""
        self.pool.open_weight_sync(trainer, transport, **plan_options)

    def publish(self, version: int) -> WeightPush:
        """Sends the trainer's weights as `version`; each worker loads them behind its queued requests."""
        self.pool.finished_pushes()  # forget the ones done
        return self.pool.push(version)

    def evaluate(self, rows: list[dict[str, Any]], max_tokens: int, threshold: float, version: int) -> dict[str, Any]:
        """Greedy evaluation on worker 0 (on a replacement if it dies meanwhile)."""
        return self.pool.call(0, "evaluate", rows, max_tokens, threshold)

    def checkpoint(self, version: int, wait_s: float | None = None, drop_first: bool = False) -> QueueCheckpoint:
        return self.queue.checkpoint(version, wait_s=wait_s, drop_first=drop_first)

    def restore(self, state: QueueCheckpoint, version: int) -> None:
        self.queue.restore(state)

    def has_untrained(self) -> bool:
        return len(self.queue) > 0

    def close(self) -> None:
        """Closes the weight transport (shared memory, broadcast group); the actors stay up."""
        self.pool.close()
