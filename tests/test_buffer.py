"""The trajectory buffer's admission control, simulated with random worker speeds (no Ray, no vLLM).

A small discrete-event simulation plays `ContinuousRollouts`' protocol against
`TrajectoryBuffer`: admitted groups go to the least-loaded of W workers, each takes a random
time, workers take new weights whenever the trainer publishes (at a random delay), the trainer
trains a step as soon as its groups are in, and any worker may die, losing what it was running.
Hypothesis draws the job's shape, the odds of skipped steps and deaths, and the seed of the
event timings.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.data import PromptStream
from titanrl.driver.sources.buffer import TrajectoryBuffer
from titanrl.types import Group, Sample


def _group(group_id: int, version: int) -> Group:
    sample = Sample(prompt="p", completion="c", prompt_ids=[1], completion_ids=[2], gen_logprobs=[0.0],
                    reward=0.0, group_id=group_id, policy_version=version)
    return Group([sample])


def _buffer(prompts_per_step: int, max_staleness: int, steps: int) -> TrajectoryBuffer:
    rows = [{"prompt": f"row {i}"} for i in range(7)]
    return TrajectoryBuffer(PromptStream(rows, prompts_per_step, seed=0), prompts_per_step, max_staleness, steps,
                            seed_of_group=lambda gid: 1000 + gid)


@dataclass
class Chaos:
    """Randomness of one simulated run."""

    seed: int
    """Seeds the group durations, push delays and waits."""
    skip_odds: float
    """Chance that a step is skipped (non-finite): the version does not advance."""
    death_odds: float
    """Chance that a worker dies as a group of it finishes (losing that group and its others)."""


chaos = st.builds(Chaos, st.integers(0, 2**32), st.sampled_from([0.0, 0.3]), st.sampled_from([0.0, 0.1, 0.3]))


def simulate(ch: Chaos, prompts_per_step: int, max_staleness: int, steps: int, workers: int,
             checkpoint_at: int | None = None) -> dict:
    """Runs a whole job; returns what was trained, the staleness of every trained group, and more."""
    rng = random.Random(ch.seed)
    buffer = _buffer(prompts_per_step, max_staleness, steps)
    clock, order = 0.0, itertools.count()
    events: list[tuple[float, int, str, tuple]] = []
    worker_version = [0] * workers
    load = [0] * workers
    running: dict[int, tuple[int, int]] = {}  # group id -> (worker, version it started from)
    trained: list[int] = []
    staleness: list[int] = []
    admitted_before: dict[int, int] = {}  # group id -> steps completed when it was admitted
    completed, version = 0, 0

    def start(task) -> None:
        w = min(range(workers), key=lambda k: load[k])
        load[w] += 1
        # A worker may only start a group once it holds its min_version (ContinuousRolloutWorker waits).
        begin = max(worker_version[w], task.min_version)
        wait = 0.0 if worker_version[w] >= task.min_version else rng.uniform(0.01, 1.0)
        running[task.group_id] = (w, begin)
        duration = rng.uniform(0.01, 5.0)
        heapq.heappush(events, (clock + wait + duration, next(order), "finish", (task.group_id, w)))

    def admit() -> None:
        for task in buffer.admit(completed, version):
            admitted_before[task.group_id] = completed
            start(task)

    admit()
    while completed < steps:
        if buffer.ready(completed + 1):
            step = completed + 1
            groups = buffer.take(step)
            trained += [g.samples[0].group_id for g in groups]
            staleness += [version - g.policy_version for g in groups]
            completed = step
            if rng.random() >= ch.skip_odds:  # a skipped step keeps the version
                version += 1
                for w in range(workers):
                    delay = rng.uniform(0.0, 2.0)
                    heapq.heappush(events, (clock + delay, next(order), "weights", (w, version)))
            if checkpoint_at == step:
                state = buffer.state_dict()
                buffer = _buffer(prompts_per_step, max_staleness, steps)
                buffer.load_state_dict(state)
                running.clear()  # the workers' results of that moment are lost with the driver
                load = [0] * workers
                events = [e for e in events if e[2] != "finish"]
                for task in buffer.unfinished():
                    start(buffer.retry(task.group_id, version))
            admit()
            continue
        clock, _, kind, payload = heapq.heappop(events)
        if kind == "weights":
            w, v = payload
            worker_version[w] = max(worker_version[w], v)
        elif kind == "finish":
            gid, w = payload
            if running.get(gid, (None,))[0] != w:
                continue  # lost: the worker died, or the driver restarted
            load[w] -= 1
            _, started_version = running.pop(gid)
            if rng.random() < ch.death_odds:
                lost = [g for g, (ww, _) in running.items() if ww == w] + [gid]
                for g in lost:
                    running.pop(g, None)
                load[w] = 0
                worker_version[w] = version  # a replacement loads the newest weights
                for g in sorted(lost):
                    start(buffer.retry(g, version))
                continue
            buffer.finish(gid, _group(gid, started_version))
    return {"trained": trained, "staleness": staleness, "admitted_before": admitted_before, "buffer": buffer}


@settings(max_examples=60, deadline=None)
@given(ch=chaos, prompts_per_step=st.integers(1, 4), max_staleness=st.integers(0, 3),
       steps=st.integers(1, 8), workers=st.integers(1, 3))
def test_staleness_bound_holds_and_every_group_is_trained_once(ch, prompts_per_step, max_staleness, steps, workers):
    """Whatever the worker speeds, push delays, skipped steps and worker deaths: every trained group is
    within max_staleness versions of the trainer, each group is trained exactly once, in its own step."""
    out = simulate(ch, prompts_per_step, max_staleness, steps, workers)
    assert sorted(out["trained"]) == list(range(steps * prompts_per_step))
    assert len(set(out["trained"])) == len(out["trained"])
    assert max(out["staleness"]) <= max_staleness
    assert min(out["staleness"]) >= 0
    assert out["buffer"].in_flight == 0 and out["buffer"].groups_waiting == 0


@settings(max_examples=30, deadline=None)
@given(ch=chaos, prompts_per_step=st.integers(1, 3), steps=st.integers(1, 6), workers=st.integers(1, 3))
def test_max_staleness_zero_is_synchronous(ch, prompts_per_step, steps, workers):
    """With max_staleness=0 no group of step s is admitted before step s-1 completed: on-policy GRPO."""
    out = simulate(ch, prompts_per_step, 0, steps, workers)
    for gid, completed in out["admitted_before"].items():
        assert completed == gid // prompts_per_step  # admitted exactly when the step before it finished
    assert set(out["staleness"]) == {0}


@settings(max_examples=30, deadline=None)
@given(ch=chaos, at=st.integers(1, 5), max_staleness=st.integers(0, 2), steps=st.integers(2, 6), workers=st.integers(1, 3))
def test_checkpoint_restore_loses_and_repeats_nothing(ch, at, max_staleness, steps, workers):
    """A checkpoint taken after any step and restored into a fresh buffer (in-flight work lost) still
    trains every group exactly once, within the staleness bound."""
    out = simulate(ch, 2, max_staleness, steps, workers, checkpoint_at=min(at, steps - 1))
    assert sorted(out["trained"]) == list(range(steps * 2))
    assert max(out["staleness"]) <= max_staleness


def test_misuse_is_refused():
    """A group cannot finish twice, finish unadmitted, be retried after finishing, or be taken early."""
    buffer = _buffer(2, 1, 3)
    tasks = buffer.admit(0, 0)
    assert [t.step for t in tasks] == [1, 1, 2, 2]
    assert [t.seed for t in tasks] == [1000, 1001, 1002, 1003]
    with pytest.raises(KeyError, match="not admitted"):
        buffer.finish(99, _group(99, 0))
    buffer.finish(0, _group(0, 0))
    with pytest.raises(ValueError, match="finished twice"):
        buffer.finish(0, _group(0, 0))
    with pytest.raises(ValueError, match="not generated twice"):
        buffer.retry(0, 1)
    with pytest.raises(RuntimeError, match="not ready"):
        buffer.take(1)
    assert buffer.admit(0, 0) == []  # nothing more until step 1 is done
