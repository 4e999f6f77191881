"""The trajectory buffer's guarantees, checked through the real `ContinuousRollouts` (real Ray, no vLLM).

The unit under test is the continuous rollout source: its admission (`TrajectoryBuffer`), its
dispatch to the least-loaded worker, its replacement of dead workers (`WorkerPool`), its
checkpoint and restore. The workers are stand-in Ray actors that honour the calls the source
makes of a `ContinuousRolloutWorker` without an engine: a group takes a random time and may kill
its worker's process (`os._exit`, as an out-of-memory kill would); weights land after a random
delay, in push order; `generate_group` waits for `min_version` with the product's own
`AsyncGenerator.wait_for_version`, and the source's `generate_groups` streams are the product's
own `GroupStream`. Live workers of a finished run serve the next one after a `reset` (an actor
start costs seconds); a replacement is a kept one or a new actor. The test plays the GRPO loop
(fill, next_step, trained, publish) with random skipped steps. Hypothesis draws the job's shape
and the randomness.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from titanrl.data import PromptStream
from titanrl.driver.sources.base import RolloutWorkersFailed
from titanrl.driver.sources.buffer import TrajectoryBuffer
from titanrl.driver.sources.continuous import ContinuousRollouts
from titanrl.rollout.group_stream import GroupStream
from titanrl.types import Group, Sample

ROWS = [{"prompt": f"row {i}"} for i in range(7)]
MAX_IDLE_WORKERS = 3
"""Workers of finished runs the fleet keeps for the next run (a run has at most 3)."""
HANG_GUARD_S = 120
"""Longest a run may go without starting a worker or finishing a group (stand-in groups take milliseconds)."""


def _seed_of_group(group_id: int) -> int:
    return 1000 + 7 * group_id


class _VersionOnlyEngine:
    """What `AsyncGenerator`'s weight-version bookkeeping reads of a VllmEngine."""

    def __init__(self) -> None:
        self.policy_version = 0

    def update_weights(self, state_dict: dict, version: int, recompute_running: bool = False) -> None:
        self.policy_version = int(version)


class StandInWorker(GroupStream):
    """A `ContinuousRolloutWorker` without an engine (see the module docstring)."""

    def __init__(self, seed: int, death_odds: float, group_s: float = 0.0) -> None:
        self._start_run(seed, death_odds, group_s)

    def _start_run(self, seed: int, death_odds: float, group_s: float) -> None:
        from titanrl.rollout.vllm.async_engine import AsyncGenerator

        self.rng, self.death_odds, self.group_s = random.Random(seed), death_odds, group_s
        self.generator = AsyncGenerator(_VersionOnlyEngine())  # type: ignore[arg-type]
        self.updates = asyncio.Lock()  # weights land in push order, as the real worker's lock makes them

    async def reset(self, seed: int, death_odds: float, group_s: float) -> None:
        """A new run's state (weights at version 0) for a kept actor. Calls of the earlier run that are
        still running finish on that run's objects and do not die: a reused actor is a fresh worker."""
        self._start_run(seed, death_odds, group_s)

    async def generate_group(self, row: dict[str, Any], seed: int, group_id: int, min_version: int) -> Group:
        generator, rng = self.generator, self.rng
        await generator.wait_for_version(min_version)
        started = generator.engine.policy_version
        await asyncio.sleep(self.group_s + rng.uniform(0.0, 0.01))
        if rng.random() < self.death_odds and generator is self.generator:
            os._exit(1)
        sample = Sample(prompt=row["prompt"], completion="c", prompt_ids=[1], completion_ids=[2], gen_logprobs=[0.0],
                        reward=0.0, group_id=group_id, policy_version=started,
                        fields={"seed": seed, "min_version": min_version})
        return Group([sample])

    async def _load(self, version: int, delay: float) -> float:
        generator, updates = self.generator, self.updates
        async with updates:
            await asyncio.sleep(delay)
            await generator.update_weights({}, version)
        return delay

    async def update_weights(self, state_dict: dict, version: int) -> float:
        return await self._load(version, 0.0)

    async def receive_weights(self, announcement: Any, version: int) -> float:
        return await self._load(version, self.rng.uniform(0.0, 0.02))

    def open_weight_sync(self, plan: Any, rank: int) -> None:
        pass

    def close_weight_sync(self) -> None:
        pass

    async def ready(self) -> dict:
        return {}


class StandInTrainer:
    """The trainer's side of the object-store transport, with nothing to send."""

    def open_weight_sync(self, plan: Any) -> None:
        pass

    def publish_weights(self, version: int) -> int:
        return version

    def send_weights(self, version: int) -> float:
        return 0.0

    def state_dict_for_push(self) -> dict:
        return {}

    def close_weight_sync(self) -> None:
        pass


class Fleet:
    """Starts the stand-in actors (one trainer for the whole module) and keeps the live workers of
    finished runs for the next ones: starting an actor (a process importing Ray) costs seconds."""

    def __init__(self, ray: Any) -> None:
        from ray import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
        self.ray = ray
        self.worker_cls = ray.remote(max_concurrency=1000)(StandInWorker)
        self.trainer = ray.remote(StandInTrainer).remote()
        self.rng = random.Random(0)
        self.death_odds = 0.0
        self.group_s = 0.0
        """Seconds each group takes at least (a worker killed at once then dies with its group unfinished)."""
        self.started = 0
        """Workers handed out so far (the hang guard counts a replacement as progress)."""
        self.idle: list[Any] = []
        """Live workers of finished runs, reset before they are handed out again."""

    def make_worker(self, slot: int) -> Any:
        from ray.exceptions import RayActorError

        self.started += 1
        seed = self.rng.randrange(2**32)
        while self.idle:
            worker = self.idle.pop()
            try:
                # before any call of the new run
                self.ray.get(worker.reset.remote(seed, self.death_odds, self.group_s))
                return worker
            except RayActorError:  # died after its run finished
                continue
        return self.worker_cls.remote(seed, self.death_odds, self.group_s)

    def release(self, actors: list[Any], reuse: bool = True) -> None:
        """Keeps `actors` for later runs (up to a few), or kills them."""
        for actor in actors:
            if reuse and len(self.idle) < MAX_IDLE_WORKERS:
                self.idle.append(actor)
            else:
                self.ray.kill(actor)


@pytest.fixture(scope="module")
def fleet(ray_session):
    fleet = Fleet(ray_session)
    yield fleet
    idle, fleet.idle = fleet.idle, []
    fleet.release(idle, reuse=False)


@dataclass
class Chaos:
    """Randomness of one run."""

    seed: int
    """Seeds the group durations, push delays and deaths."""
    skip_odds: float
    """Chance that a step is skipped (non-finite): the version does not advance, nothing is pushed."""
    death_odds: float
    """Chance that a worker's process dies while generating a group (losing every group it runs)."""


chaos = st.builds(Chaos, st.integers(0, 2**32), st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.05, 0.2]))


@contextmanager
def hang_guard(seconds: int, progress: Callable[[], object]):
    """Fails the test instead of hanging when a lost group is never generated again. Every `seconds`
    it compares `progress()` (workers started, groups finished) with its last look and fails only if
    nothing moved: a slow but live run (actors start slowly on a loaded machine) is not a lost group."""
    seen = [progress()]

    def check(*_: Any) -> None:
        now = progress()
        if now == seen[0]:
            raise TimeoutError(f"the run made no progress for {seconds} s: a group was lost")
        seen[0] = now
        signal.alarm(seconds)

    old = signal.signal(signal.SIGALRM, check)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class ShiftingCapacity:
    """Stands in for `ElasticCapacity` (the cluster's nodes): at each step's look 0-2 nodes join,
    and a dead worker's node is gone with the given odds (its slot is dropped, not replaced)."""

    def __init__(self, seed: int, lost_odds: float) -> None:
        self.rng, self.lost_odds = random.Random(seed), lost_odds
        self.joined = self.dropped = 0

    def new_homes(self) -> list[str]:
        homes = [f"node-{self.joined + k}" for k in range(self.rng.choice([0, 0, 1, 2]))]
        self.joined += len(homes)
        return homes

    def node_lost(self, home: Any) -> bool:
        return self.rng.random() < self.lost_odds

    def release(self, home: Any) -> None:
        self.dropped += 1

    def describe(self, home: Any) -> str:
        return str(home)


def _source(fleet: Fleet, prompts_per_step: int, max_staleness: int, steps: int, workers: int,
            max_deaths_in_a_row: int = 10**6, elastic: ShiftingCapacity | None = None) -> ContinuousRollouts:
    buffer = TrajectoryBuffer(PromptStream(ROWS, prompts_per_step, seed=0), prompts_per_step, max_staleness, steps,
                              _seed_of_group)
    source = ContinuousRollouts(fleet.make_worker, workers, buffer, max_deaths_in_a_row=max_deaths_in_a_row,
                                elastic=elastic)  # type: ignore[arg-type]
    source.open_weight_sync(fleet.trainer, "object_store")
    return source


def run(fleet: Fleet, ch: Chaos, prompts_per_step: int, max_staleness: int, steps: int, workers: int,
        checkpoint_at: int | None = None, elastic: ShiftingCapacity | None = None) -> dict:
    """Plays the GRPO loop against a real ContinuousRollouts; returns what each step trained on."""
    rng = random.Random(ch.seed)
    fleet.rng, fleet.death_odds = random.Random(ch.seed + 1), ch.death_odds
    source = _source(fleet, prompts_per_step, max_staleness, steps, workers, elastic=elastic)
    sizes = []
    trained: dict[int, list[Sample]] = {}
    staleness: list[int] = []
    admitted_at: dict[int, int] = {}  # group id -> steps completed when it was admitted
    version, restarts = 0, 0
    live = [source]  # the source of the current attempt (a restore replaces it)
    try:
        with hang_guard(HANG_GUARD_S, lambda: (fleet.started, len(trained), len(live[0].buffer.finished))):
            source.fill(0, version)
            admitted_at.update({gid: 0 for gid in source.buffer.tasks})
            for step in range(1, steps + 1):
                rollouts = source.next_step(step)
                groups = rollouts.groups
                sizes.append(rollouts.metrics["rollout/workers"])
                trained[step] = [g.samples[0] for g in groups]
                staleness += [version - g.policy_version for g in groups]
                source.trained(step)
                if rng.random() >= ch.skip_odds:
                    version += 1
                    source.publish(version)
                if checkpoint_at == step:  # the driver restarts: what was in flight is lost
                    state = source.checkpoint(version)
                    restarts += source.restarts
                    source.close()
                    fleet.release(source.workers, reuse=False)  # their in-flight groups die with them
                    source = live[0] = _source(fleet, prompts_per_step, max_staleness, steps, workers)
                    source.restore(state, version)
                    source.publish(version)
                source.fill(step, version)
                admitted_at.update({gid: step for gid in source.buffer.tasks if gid not in admitted_at})
            restarts += source.restarts
            left = (source.buffer.in_flight, source.buffer.groups_waiting)
    finally:
        source.close()
        fleet.release(source.workers)
    return {"trained": trained, "staleness": staleness, "admitted_at": admitted_at, "left": left,
            "restarts": restarts, "sizes": sizes}


def _check_trained(out: dict, prompts_per_step: int, steps: int) -> None:
    """Each step trained exactly its own groups, once, with their own seeds, started from weights
    no older than their min_version."""
    for step, samples in out["trained"].items():
        assert [s.group_id for s in samples] == list(range((step - 1) * prompts_per_step, step * prompts_per_step))
        assert all(s.fields["seed"] == _seed_of_group(s.group_id) for s in samples)
        assert all(s.policy_version >= s.fields["min_version"] for s in samples)
    assert sorted(out["trained"]) == list(range(1, steps + 1))
    assert out["left"] == (0, 0)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.slow
@settings(max_examples=8, **SETTINGS)
@given(ch=chaos, prompts_per_step=st.integers(1, 3), max_staleness=st.integers(0, 3),
       steps=st.integers(1, 6), workers=st.integers(1, 3))
def test_staleness_bound_holds_and_every_group_is_trained_once(fleet, ch, prompts_per_step, max_staleness, steps,
                                                                workers):
    """Whatever the worker speeds, push delays, skipped steps and worker deaths: every trained group is
    within max_staleness versions of the trainer, and each is trained exactly once, in its own step
    (a dead worker's groups are generated again by its replacement)."""
    out = run(fleet, ch, prompts_per_step, max_staleness, steps, workers)
    _check_trained(out, prompts_per_step, steps)
    assert 0 <= min(out["staleness"]) and max(out["staleness"]) <= max_staleness


@pytest.mark.slow
@settings(max_examples=5, **SETTINGS)
@given(ch=chaos, prompts_per_step=st.integers(1, 3), steps=st.integers(1, 5), workers=st.integers(1, 3))
def test_max_staleness_zero_is_synchronous(fleet, ch, prompts_per_step, steps, workers):
    """With max_staleness=0 no group of step s is admitted before step s-1 completed: on-policy GRPO."""
    out = run(fleet, ch, prompts_per_step, 0, steps, workers)
    _check_trained(out, prompts_per_step, steps)
    for gid, completed in out["admitted_at"].items():
        assert completed == gid // prompts_per_step  # admitted exactly when the step before it finished
    assert set(out["staleness"]) == {0}


@pytest.mark.slow
@settings(max_examples=5, **SETTINGS)
@given(ch=chaos, at=st.integers(1, 4), max_staleness=st.integers(0, 2), steps=st.integers(2, 5),
       workers=st.integers(1, 3))
def test_checkpoint_restore_loses_and_repeats_nothing(fleet, ch, at, max_staleness, steps, workers):
    """A checkpoint taken after any step and restored into a fresh source with fresh workers (what
    was in flight is lost) still trains every group exactly once, within the staleness bound."""
    out = run(fleet, ch, 2, max_staleness, steps, workers, checkpoint_at=min(at, steps - 1))
    _check_trained(out, 2, steps)
    assert max(out["staleness"]) <= max_staleness


@pytest.mark.slow
@settings(max_examples=6, **SETTINGS)
@given(ch=chaos, lost_odds=st.sampled_from([0.5, 1.0]), max_staleness=st.integers(0, 2), steps=st.integers(2, 6),
       workers=st.integers(1, 3))
def test_elastic_workers_come_and_go_without_losing_or_repeating_a_group(fleet, ch, lost_odds, max_staleness,
                                                                         steps, workers):
    """rollout.elastic: nodes join at step boundaries (a worker each, loading the current weights) and
    dead workers' nodes are lost (their slots dropped, their groups handed to the others, the last
    worker replaced instead): every group is still trained exactly once, within the staleness
    bound, and rollout/workers follows the joins and drops."""
    capacity = ShiftingCapacity(ch.seed, lost_odds)
    out = run(fleet, ch, 2, max_staleness, steps, workers, elastic=capacity)
    _check_trained(out, 2, steps)
    assert max(out["staleness"]) <= max_staleness
    assert out["sizes"][-1] <= workers + capacity.joined - capacity.dropped  # joins after the last step count later
    assert min(out["sizes"]) >= 1


def test_a_source_grows_and_drops_workers(fleet):
    """The elastic moves themselves, on a real source: two joins add two workers before anything is
    dispatched, and they take groups once they are up; a worker killed while its node is lost is
    dropped, not replaced (no restart), and its group finishes on the others."""
    import ray

    capacity = ShiftingCapacity(0, 1.0)
    capacity.new_homes = lambda: ["node-a", "node-b"]  # type: ignore[method-assign]
    # Groups of 1 s: the worker killed right after a dispatch dies with its group unfinished (with
    # groups of ~5 ms it could finish first, and the run never met the death).
    fleet.rng, fleet.death_odds, fleet.group_s = random.Random(3), 0.0, 1.0
    source = _source(fleet, 3, 1, 3, 1, elastic=capacity)
    try:
        source.fill(0, 0)  # steps 1 and 2's groups (to the joined workers only if already up)
        assert len(source.workers) == 3 and source.pool.homes == [0, "node-a", "node-b"]
        capacity.new_homes = lambda: []  # type: ignore[method-assign]
        ray.get([ready for ready, _ in source.starting.values()])
        assert [g.samples[0].group_id for g in source.next_step(1).groups] == [0, 1, 2]
        source.trained(1)
        source.fill(1, 0)  # step 3's groups, to the least-loaded workers: each of 1 and 2 gets one at least
        assert {call.slot for call in source.in_flight.values()} >= {1, 2}
        fleet.ray.kill(source.workers[1])
        assert [g.samples[0].group_id for g in source.next_step(2).groups] == [3, 4, 5]
        source.trained(2)
        third = source.next_step(3)
        assert [g.samples[0].group_id for g in third.groups] == [6, 7, 8]
        assert third.metrics["rollout/workers"] == 2.0 and source.restarts == 0
        assert source.pool.homes == [0, "node-b"] and len(source.load) == len(source.idle_since) == 2
    finally:
        fleet.group_s = 0.0
        source.close()
        fleet.release(source.workers)


@pytest.mark.slow
def test_a_slot_that_keeps_dying_stops_the_run(fleet):
    """Workers that die on every group: after max_deaths_in_a_row deaths of one slot with nothing
    finished in between, the source stops the run with RolloutWorkersFailed saying so."""
    fleet.rng, fleet.death_odds = random.Random(1), 1.0
    source = _source(fleet, 1, 0, 2, 1, max_deaths_in_a_row=3)
    try:
        with hang_guard(HANG_GUARD_S, lambda: fleet.started), \
                pytest.raises(RolloutWorkersFailed, match="died 3 times in a row"):
            source.fill(0, 0)
            source.next_step(1)
        assert source.restarts == 2
    finally:
        source.close()
        fleet.death_odds = 0.0


def test_misuse_is_refused():
    """A group cannot finish twice, finish unadmitted, be retried after finishing, or be taken early."""
    buffer = TrajectoryBuffer(PromptStream(ROWS, 2, seed=0), 2, 1, 3, _seed_of_group)
    tasks = buffer.admit(0, 0)
    assert [t.step for t in tasks] == [1, 1, 2, 2]
    assert [t.seed for t in tasks] == [_seed_of_group(g) for g in range(4)]
    group = Group([Sample(prompt="p", completion="c", prompt_ids=[1], completion_ids=[2], gen_logprobs=[0.0],
                          reward=0.0, group_id=0, policy_version=0)])
    with pytest.raises(KeyError, match="not admitted"):
        buffer.finish(99, group)
    buffer.finish(0, group)
    with pytest.raises(ValueError, match="finished twice"):
        buffer.finish(0, group)
    with pytest.raises(ValueError, match="not generated twice"):
        buffer.retry(0, 1)
    with pytest.raises(RuntimeError, match="not ready"):
        buffer.take(1)
    assert buffer.admit(0, 0) == []  # nothing more until step 1 is done
