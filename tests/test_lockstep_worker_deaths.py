"""Lock-step runs survive a rollout worker's death (real Ray, real vLLM, tiny model).

A reward that SIGKILLs its own worker process at a chosen call (`support.worker_deaths.killing_reward`)
is a worker dying mid-request, exactly as an out-of-memory kill would. The replacement loads the
trainer's current weights and is handed the dead worker's part of the request with the same rows
and seeds; with batch_invariant=True the run's metrics then equal an undisturbed run's bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import titanrl

from support.worker_deaths import alive_run_actors, arm, killing_reward, run_config, shm_names

KILL_AT = 8 + 16 + 3
"""Reward call that kills its worker: past the 8 evaluation calls of step 0 and step 1's 16 samples,
inside step 2's request."""


def _lockstep_config(tmp_path: Path, tiny_run, **rollout) -> titanrl.RunConfig:
    config = run_config(tmp_path, tiny_run, killing_reward, num_workers=2, **rollout)
    config.rollout.continuous = False
    config.train.steps, config.train.max_staleness = 3, 0
    config.output.save_every_steps = 0
    config.batch_invariant = True
    return config


def _columns(metrics: list[dict]) -> list[tuple]:
    return [(m["step"], m["loss"], m["reward/mean"], m["grad_norm"], m.get("eval/accuracy"))
            for m in metrics if m["step"] > 0]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, ray_session, tiny_run) -> list[tuple]:
    """The undisturbed run's columns, pushed through the object store: a transport moves the same
    weights, so it cannot change a bit of them (the killed broadcast run is compared with these)."""
    run_dir = tmp_path_factory.mktemp("undisturbed")
    arm(run_dir, kill_at=10**9)
    reference = titanrl.train(_lockstep_config(run_dir, tiny_run, weight_transport="object_store"))
    assert reference.metrics[-1]["workers/restarts"] == 0.0
    return _columns(reference.metrics)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["broadcast"])
def test_killed_lockstep_worker_is_replaced_and_the_run_equals_an_undisturbed_one(tmp_path, ray_session, tiny_run,
                                                                                  undisturbed, transport):
    """A lock-step run (2 workers, max_staleness=0, batch_invariant=True) whose worker is SIGKILLed in
    step 2's request completes all 3 steps with workers/restarts == 1, and its loss, reward/mean,
    grad_norm and eval accuracy equal an undisturbed run's to the bit: the replacement joined the
    weight transport (re-formed with it: broadcast's members are fixed when it opens), held the current weights, and
    generated the dead worker's part with the same seeds. Every step's push reached the workers (the
    evaluations after steps 2 and 3 report those versions), and once `train` returns no shared-memory
    segment it created is left in /dev/shm and no actor of the run is alive.

    The killed run pushes by broadcast and the undisturbed one through the object store. Broadcast
    takes the branch of `WorkerPool._start_replacement` that closes and re-opens the transport with
    the replacement in it and settles the pushes a dead member failed; the rest (the replacement
    loads the trainer's current weights, takes over the dead worker's part) is the same for every
    transport. The other transports' parts of a replacement are checked elsewhere:
    shared_memory's re-formed transport and segment cleanup after a death by
    tests/test_continuous_runs.py::test_killed_worker_is_replaced_and_every_group_is_trained_exactly_once,
    object_store's (the replacement joins the open session and receives every later push, or its
    groups would wait forever for their min_version) by the real `WorkerPool` under worker deaths in
    tests/test_buffer.py::test_staleness_bound_holds_and_every_group_is_trained_once, and in an
    object_store run by tests/test_continuous_runs.py::test_worker_that_keeps_dying_stops_the_run_with_a_checkpoint."""
    arm(tmp_path / "killed", kill_at=KILL_AT)
    (tmp_path / "killed").mkdir()
    before = shm_names()
    killed = titanrl.train(_lockstep_config(tmp_path / "killed", tiny_run, weight_transport=transport))

    assert [m["step"] for m in killed.metrics if m["step"] > 0] == [1, 2, 3]
    assert killed.metrics[-1]["workers/restarts"] == 1.0
    assert _columns(killed.metrics) == undisturbed
    evals = {m["step"]: m["eval/policy_version"] for m in killed.metrics if "eval/policy_version" in m}
    assert evals == {0: 0, 2: 2, 3: 3}
    assert shm_names() - before == set()
    assert alive_run_actors() == []
