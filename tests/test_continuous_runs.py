"""Continuous runs end to end (real Ray, real vLLM): the buffer, worker deaths, a dead trainer.

The reward functions of `support.worker_deaths` kill processes on purpose: the reward runs inside the rollout worker's
process, so `os.kill(os.getpid(), SIGKILL)` there is a worker dying mid-generation, exactly as an
out-of-memory kill would. Call counts are kept in files (workers are separate processes).
"""

from __future__ import annotations

import json

import pytest

import titanrl
from titanrl.errors import RunStopped
from titanrl.rundir.checkpoints import latest_checkpoint

from support.worker_deaths import (
    alive_run_actors,
    arm,
    killing_reward,
    run_config,
    shm_names,
    trainer_killing_reward,
)

@pytest.fixture(scope="module")
def killed_worker_run(tmp_path_factory, ray_session, tiny_run) -> dict:
    """A 4-step continuous run (2 workers, shared memory, a checkpoint after every step) whose worker
    0 or 1 is SIGKILLed at reward call 24 of 64 (inside step 2's or 3's groups). What the killed-worker
    test checks is read here, before the resume test continues the same run directory."""
    tmp_path = tmp_path_factory.mktemp("killed_worker")
    arm(tmp_path, kill_at=24)
    before = shm_names()
    config = run_config(tmp_path, tiny_run, killing_reward, num_workers=2, weight_transport="shared_memory",
                     threads_when_rollouts_idle=2)
    result = titanrl.train(config)
    rows = [json.loads(line) for line in (result.run_dir / "rollouts.jsonl").read_text().splitlines()]
    return dict(config=config, result=result, rows=rows, shm_left=shm_names() - before, alive=alive_run_actors())


@pytest.mark.slow
def test_killed_worker_is_replaced_and_every_group_is_trained_exactly_once(killed_worker_run):
    """Worker 0 or 1 is SIGKILLed mid-run (reward call 24 of 64, inside step 2's or 3's groups) of a run
    pushing weights through shared memory, its trainer taking idle workers' cores
    (train.compute.threads_when_rollouts_idle). The run finishes: a replacement joined the re-formed
    transport, took the newest weights and regenerated the lost groups; every step trained exactly
    its own 4 groups (no group lost, none twice); staleness stayed <= 1; the buffer and idle metrics
    are logged; every step's push reached the workers (eval after the last step reports its
    version); no shared-memory segment it created is left in /dev/shm and no actor of the run is
    alive. (Lock-step runs: tests/test_lockstep_worker_deaths.py, broadcast; this test is the one that
    kills a worker of a shared_memory run.)"""
    result = killed_worker_run["result"]
    steps = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert steps[-1]["workers/restarts"] == 1.0
    for m in steps:
        assert m["staleness/max"] <= 1
        for key in ("buffer/groups_waiting", "buffer/groups_in_flight", "time/trainer_idle_s", "time/worker_idle_s"):
            assert isinstance(m[key], float), key
        assert 0.0 <= m["train/rollouts_idle_frac"] <= 1.0
    assert any("time/weight_sync_s" in m for m in steps)
    for m in steps:  # the load itself is a part of the push's wall time (which waits for a moment to load)
        if "time/weight_sync_s" in m:
            assert 0.0 < m["time/weight_load_s"] <= m["time/weight_sync_s"]
    evals = {m["step"]: m["eval/policy_version"] for m in result.metrics if "eval/policy_version" in m}
    assert evals == {0: 0, 2: 2, 4: 4}

    rows = killed_worker_run["rows"]
    for step in range(1, 5):
        ids = [r["group_id"] for r in rows if r["step"] == step]
        assert sorted(set(ids)) == list(range((step - 1) * 4, step * 4))
        assert len(ids) == 16  # 4 samples of each of its 4 groups, each group once
    assert killed_worker_run["shm_left"] == set()
    assert killed_worker_run["alive"] == []


@pytest.mark.slow
def test_worker_that_keeps_dying_stops_the_run_with_a_checkpoint(tmp_path, ray_session, tiny_run):
    """From reward call 45 on (after 8 eval and 32 step-1/2 calls: step 3's groups, admitted after step 1
    finished), every reward kills its worker: the
    replacements die too, and after three deaths in a row the run stops with a message that says so
    and the last completed step saved."""
    arm(tmp_path, kill_at=45, every_later_call=True)
    config = run_config(tmp_path, tiny_run, killing_reward, num_workers=1)
    with pytest.raises(RunStopped, match="died 3 times in a row") as stopped:
        titanrl.train(config)
    saved = latest_checkpoint(config.output.dir)
    assert saved is not None and saved.step >= 1
    assert str(saved.path) in str(stopped.value)
    assert alive_run_actors() == []


@pytest.mark.slow
def test_dead_trainer_stops_the_run_cleanly_with_the_last_checkpoint(tmp_path, ray_session, tiny_run):
    """The trainer's process is SIGKILLed mid-run (reward call 60: past 8 eval and 48 step-1..3 calls, so
    step 4's groups or step 2's eval, both after step 1's checkpoint): the run stops with RunStopped
    naming the newest checkpoint, and no actor of the run is left alive."""
    arm(tmp_path, kill_at=60)
    config = run_config(tmp_path, tiny_run, trainer_killing_reward, num_workers=1)
    with pytest.raises(RunStopped) as stopped:
        titanrl.train(config)
    saved = latest_checkpoint(config.output.dir)
    assert saved is not None and saved.step >= 1
    assert str(saved.path) in str(stopped.value)
    assert alive_run_actors() == []


@pytest.mark.slow
def test_continuous_run_resumes_from_a_checkpoint_without_losing_or_repeating_groups(killed_worker_run, tmp_path):
    """The killed-worker test's 4-step continuous run (checkpoint after step 3, step 4's groups in the
    buffer or in flight when it was written), resumed from step 3 with train.steps=6: steps 4-6 run,
    each on exactly its own 4 groups (the stored finished ones and the regenerated unfinished ones
    alike), within the staleness bound, and metrics.jsonl reads as one run."""
    config = killed_worker_run["config"]
    assert latest_checkpoint(config.output.dir).step == 3  # the last step is exported, not checkpointed
    arm(tmp_path, kill_at=10**9)
    config.train.steps = 6
    result = titanrl.train(config, resume=True)

    steps = [m["step"] for m in result.metrics if m["step"] > 0]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert all(m["staleness/max"] <= 1 for m in result.metrics if m["step"] > 0)
    rows = [json.loads(line) for line in (result.run_dir / "rollouts.jsonl").read_text().splitlines()]
    for step in range(1, 7):
        ids = [r["group_id"] for r in rows if r["step"] == step]
        assert sorted(set(ids)) == list(range((step - 1) * 4, step * 4)) and len(ids) == 16
