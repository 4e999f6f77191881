"""Continuous rollouts: rollout worker actors generating group by group into the trajectory buffer.

The driver hands every admitted group (`titanrl.driver.sources.buffer`) to the least-loaded worker;
each worker gets its share of one admission in one streaming call (`generate_groups`,
`titanrl.rollout.group_stream`), which hands every group back as soon as it finishes, so a slow
group holds back neither its worker nor the others, and the driver pays one Ray call per worker
per step instead of one per group. Workers take new weights between engine steps
(`ContinuousRolloutWorker`), so pushing never waits for generation to drain.

A worker that dies (its process killed, out of memory) is replaced by a new actor that loads
the newest weights (`titanrl.driver.sources.workers.WorkerPool`, as in lock-step runs); the
groups it was running are generated again, from those weights. No group is lost or trained
twice: the buffer knows each one by id. A worker slot that dies `MAX_DEATHS_IN_A_ROW` times
without finishing a group in between stops the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from titanrl.data import PromptStream
from titanrl.driver.elastic import ElasticCapacity
from titanrl.driver.sources.base import RolloutSource
from titanrl.driver.sources.buffer import BufferState, GroupTask, TrajectoryBuffer
from titanrl.driver.sources.workers import MAX_DEATHS_IN_A_ROW, WorkerPool
from titanrl.types import StepRollouts, group_tokens
from titanrl.weight_sync import WeightPush

log = logging.getLogger("titanrl")


@dataclass
class _StreamCall:
    """One `generate_groups` call in flight: its worker, and the groups it has not returned yet."""

    slot: int
    actor: Any
    """The actor running it (a replacement of the slot does not take it over)."""
    tasks: dict[int, GroupTask] = field(default_factory=dict)
    """Group id -> task, for the groups the stream has not yielded yet."""


class ContinuousRollouts(RolloutSource):
    """The rollout side of a `rollout.continuous` run, as the GRPO loop sees it (a `RolloutSource`)."""

    checkpoint_type = BufferState

    def __init__(self, make_worker: Callable[[Any], Any], num_workers: int, buffer: TrajectoryBuffer,
                 max_deaths_in_a_row: int = MAX_DEATHS_IN_A_ROW, elastic: ElasticCapacity | None = None) -> None:
        """`make_worker(home)` starts a worker's actor (a `ContinuousRolloutWorker`), again for a
        replacement (see `WorkerPool`, also for `max_deaths_in_a_row`). `elastic`
        (`rollout.elastic`): workers are added as nodes join and dropped as their nodes are lost."""
        self.buffer, self.elastic = buffer, elastic
        self.pool = WorkerPool(make_worker, num_workers, max_deaths_in_a_row)
        self.starting: dict[Any, tuple[Any, float]] = {}
        """Added workers (rollout.elastic) whose engine is still starting -> their `ready` call and
        when they were added."""
        self.in_flight: dict[Any, _StreamCall] = {}
        """Ray streaming generator of a `generate_groups` call -> what it still owes."""
        self.load = [0] * num_workers
        self.version = 0
        now = time.perf_counter()
        self.idle_since: list[float | None] = [now] * num_workers
        self.idle_s = 0.0
        """Worker-seconds with no group in flight since the last step's metrics."""
        self.last_step_at = now

    @property
    def workers(self) -> list[Any]:
        return self.pool.workers

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    @classmethod
    def for_run(cls, make_worker: Callable[[Any], Any], num_workers: int, stream: PromptStream,
                prompts_per_step: int, max_staleness: int, steps: int,
                seed_of_group: Callable[[int], int], elastic: ElasticCapacity | None = None) -> ContinuousRollouts:
        return cls(make_worker, num_workers,
                   TrajectoryBuffer(stream, prompts_per_step, max_staleness, steps, seed_of_group), elastic=elastic)

    # ------------------------------------------------------------------ the loop's interface

    def fill(self, completed_steps: int, version: int) -> None:
        """Admits and dispatches every group the staleness bound allows after `completed_steps`."""
        if not self.in_flight and not self.buffer.finished:  # (re)starting: time from now, not from start-up
            self.last_step_at = time.perf_counter()
            self.idle_since = [self.last_step_at] * len(self.workers)
            self.idle_s = 0.0
        self.version = version
        if self.elastic is not None and self.pool.sync is not None:
            self._grow()
        dispatched = {gid for call in self.in_flight.values() for gid in call.tasks}
        # Restored from a checkpoint, or never dispatched; then the newly admitted ones.
        retried = [self.buffer.retry(t.group_id, version) for t in self.buffer.unfinished()
                   if t.group_id not in dispatched]
        self._dispatch(retried + self.buffer.admit(completed_steps, version))

    def next_step(self, step: int) -> StepRollouts:
        """Waits until every group of `step` has finished; they stay in the buffer until `trained`."""
        t0 = time.perf_counter()
        while not self.buffer.ready(step):
            self._collect(timeout=1.0)
        self._collect(timeout=0)  # whatever else finished meanwhile, for the metrics
        waited = time.perf_counter() - t0
        groups = [self.buffer.finished[gid] for gid in self.buffer.step_group_ids(step)]
        now = time.perf_counter()
        idle = self.idle_s + sum(now - since for since in self.idle_since if since is not None)
        self.idle_s = 0.0
        self.idle_since = [now if since is not None else None for since in self.idle_since]
        cycle = now - self.last_step_at
        self.last_step_at = now
        metrics = {
            "buffer/groups_waiting": float(self.buffer.groups_waiting - len(groups)),
            "buffer/groups_in_flight": float(self.buffer.in_flight),
            "time/trainer_idle_s": waited,
            "time/worker_idle_s": idle / len(self.workers),
            "workers/restarts": float(self.restarts),
            "rollout/workers": float(len(self.workers)),
            **self._push_metrics(),
        }
        return StepRollouts(groups, sum(group_tokens(g) for g in groups), cycle, None, metrics)

    def trained(self, step: int) -> None:
        self.buffer.take(step)

    def open_weight_sync(self, trainer: Any, transport: str, **plan_options: Any) -> None:
        """Connects the trainer to every worker with `rollout.weight_transport`; `plan_options`
        are WeightSyncPlan fields (backend, host, ...)."""
        self.pool.open_weight_sync(trainer, transport, **plan_options)

    def publish(self, version: int) -> WeightPush:
        """Sends the trainer's weights as `version`; workers load them between engine steps."""
        self.version = version
        return self.pool.push(version)

    def evaluate(self, rows: list[dict[str, Any]], max_tokens: int, threshold: float, version: int) -> dict[str, Any]:
        """Greedy evaluation on worker 0 once it holds `version`, alongside the training groups (on a
        replacement if worker 0 dies meanwhile: its groups are handed out again)."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            actor = self.workers[0]
            try:
                return ray.get(actor.evaluate.remote(rows, max_tokens, threshold, version))
            except RayActorError as e:
                self._replace(0, actor, e)

    def checkpoint(self, version: int, wait_s: float | None = None, drop_first: bool = False) -> BufferState:
        """The buffer's tasks and finished groups; unfinished groups are generated again on resume.

        `drop_first` regenerates the oldest untrained step's groups too (their rewards were broken).
        """
        self._collect(timeout=0)
        state = self.buffer.state_dict()
        if drop_first and state.tasks:
            first_step = state.tasks[0][0].step
            state.tasks = [(t, None if t.step == first_step else g) for t, g in state.tasks]
        return state

    def restore(self, state: BufferState, version: int) -> None:
        self.buffer.load_state_dict(state)
        self.version = version

    def has_untrained(self) -> bool:
        return bool(self.buffer.tasks)

    # ------------------------------------------------------------------ dispatch and failures

    def _dispatch(self, tasks: list[GroupTask]) -> None:
        """Each task to the least-loaded worker; one `generate_groups` call per worker that got any.
        A worker an elastic run added gets none until its engine is up (else a step would wait
        for that start-up)."""
        import ray

        for actor, (ready, since) in list(self.starting.items()):
            if ray.wait([ready], timeout=0)[0]:
                del self.starting[actor]
                if actor in self.workers:
                    log.info(f"rollout.elastic: rollout worker {self.workers.index(actor)} is up "
                             f"({time.perf_counter() - since:.0f} s after it was added) and takes groups")
        serving = [k for k, w in enumerate(self.workers) if w not in self.starting] or list(range(len(self.workers)))
        shares: dict[int, list[GroupTask]] = {}
        for task in tasks:
            i = min(serving, key=lambda k: self.load[k])
            task.attempts += 1
            shares.setdefault(i, []).append(task)
            self._busy(i, +1)
        for i, share in shares.items():
            requests = [(t.row, t.seed, t.group_id, t.min_version) for t in share]
            stream = self.workers[i].generate_groups.options(num_returns="streaming").remote(requests)
            self.in_flight[stream] = _StreamCall(i, self.workers[i], {t.group_id: t for t in share})

    def _busy(self, i: int, change: int) -> None:
        now = time.perf_counter()
        if self.load[i] == 0 and change > 0 and self.idle_since[i] is not None:
            self.idle_s += now - self.idle_since[i]
            self.idle_since[i] = None
        self.load[i] += change
        if self.load[i] == 0:
            self.idle_since[i] = now

    def _collect(self, timeout: float) -> None:
        """Records the groups that finished within `timeout`; replaces workers that died."""
        import ray
        from ray.exceptions import RayActorError

        if not self.in_flight:
            return
        streams = list(self.in_flight)
        # Wake at the first stream with finished groups, then take every other one already there.
        ready, _ = ray.wait(streams, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(streams, num_returns=len(streams), timeout=0)
        for stream in ready:
            call = self.in_flight.get(stream)
            if call is None:
                continue  # its worker was replaced while handling an earlier stream
            try:
                finished = ray.get(next(stream))
            except StopIteration:
                missing = sorted(call.tasks)[:5]
                raise RuntimeError(f"rollout worker {call.slot}'s stream ended without groups {missing}") from None
            except RayActorError as e:
                self._replace(call.slot, call.actor, e)
                continue
            for group_id, group in finished:
                call.tasks.pop(group_id)
                self._busy(call.slot, -1)
                self.pool.served(call.slot)
                self.buffer.finish(group_id, group)
            if not call.tasks:  # all of it returned: the stream has nothing more to say
                del self.in_flight[stream]

    def _replace(self, i: int, dead: Any, error: BaseException) -> None:
        """Slot i's actor `dead` died: the pool starts a replacement with the newest weights (unless
        it did already), which is handed the groups `dead` had not returned (from all its streams).
        An elastic run drops the slot instead when its node is gone, and hands the groups to the others."""
        if self.pool.workers[i] is not dead:
            return  # replaced (or dropped) already, on an earlier stream of the same actor
        lost: list[GroupTask] = []
        for stream, call in list(self.in_flight.items()):
            if call.actor is dead:
                del self.in_flight[stream]
                for _ in call.tasks:
                    self._busy(i, -1)
                lost += call.tasks.values()
        if (self.elastic is not None and len(self.workers) > 1
                and self.elastic.node_lost(self.pool.homes[i])):
            self._drop(i)
        else:
            self.pool.replace(i, dead, error)
        if lost:
            log.info(f"{len(lost)} group(s) of the lost rollout worker are generated again")
        lost.sort(key=lambda t: t.group_id)
        self._dispatch([self.buffer.retry(task.group_id, self.version) for task in lost])

    def _grow(self) -> None:
        """A new worker in each home the cluster made room for since the last step (`rollout.elastic`)."""
        assert self.elastic is not None
        for home in self.elastic.new_homes():
            i = self.pool.add(home)
            self.starting[self.workers[i]] = (self.workers[i].ready.remote(), time.perf_counter())
            self.load.append(0)
            self.idle_since.append(time.perf_counter())
            log.info(f"rollout.elastic: a node joined: rollout worker {i} starts on {self.elastic.describe(home)} "
                     f"with version {self.pool.version} ({len(self.workers)} workers)")

    def _drop(self, i: int) -> None:
        """Slot i's node is lost: the slot goes (`rollout.elastic`); later slots move down one."""
        assert self.elastic is not None
        since = self.idle_since.pop(i)
        if since is not None:
            self.idle_s += time.perf_counter() - since
        self.load.pop(i)
        for call in self.in_flight.values():
            if call.slot > i:
                call.slot -= 1
        self.elastic.release(self.pool.remove(i))
        log.info(f"rollout.elastic: rollout worker {i}'s node is lost: the run goes on with {len(self.workers)} workers")

    def _push_metrics(self) -> dict[str, float]:
        """Of the newest push every worker has loaded: `time/weight_sync_s`, its wall time (from its
        start to the moment the driver saw it done, deferral included, so an upper bound), and
        `time/weight_load_s`, the load itself (the slowest worker's)."""
        done = [push for push in self.pool.finished_pushes() if push is not None]
        return {"time/weight_sync_s": done[-1].wall_s, "time/weight_load_s": done[-1].load_s} if done else {}

    def close(self) -> None:
        """Closes the weight transport (shared memory, broadcast group); the actors stay up."""
        self.pool.close()
