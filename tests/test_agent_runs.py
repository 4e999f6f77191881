"""Whole runs whose episodes are OpenAI-client agents (real Ray, real vLLM, the real endpoint):
lock-step with a worker killed mid-episode, and continuous rollouts with in-flight updates."""

from __future__ import annotations

from pathlib import Path

import pytest

import titanrl

from support.worker_deaths import arm, killing_agent, run_config

KILL_AT = 8 + 16 + 3
"""Agent episode that kills its worker: past step 0's 8 evaluation episodes and step 1's 16, inside step 2."""


def _agent_config(tmp_path: Path, tiny_run, continuous: bool) -> titanrl.RunConfig:
    config = run_config(tmp_path, tiny_run, tiny_run.reward, num_workers=2)
    config.rewards = []
    config.agent = titanrl.AgentConfig(fn=killing_agent)
    config.rollout.continuous = continuous
    config.train.steps = 3
    config.train.max_staleness = 1 if continuous else 0
    config.output.save_every_steps = 0
    config.batch_invariant = True
    return config


@pytest.mark.slow
def test_a_worker_killed_mid_episode_is_replaced_and_its_episodes_are_played_again(tmp_path, ray_session, tiny_run):
    """Lock-step, 2 workers: an agent SIGKILLs its worker in step 2. The run finishes all 3 steps with
    workers/restarts == 1, and no episode is counted as an error: the replacement played the dead
    worker's episodes again (with the same rows and seeds; that this replays them bit for bit is
    tests/test_lockstep_worker_deaths.py's claim, on the same replacement path)."""
    arm(tmp_path, kill_at=KILL_AT)
    killed = titanrl.train(_agent_config(tmp_path, tiny_run, continuous=False))
    steps = [m for m in killed.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert killed.metrics[-1]["workers/restarts"] == 1.0
    assert all(m["reward/errors"] == 0 and m["agent/calls_per_episode"] == 1.0 for m in steps)


@pytest.mark.slow
def test_continuous_agent_runs_keep_every_call_on_one_version_within_the_staleness_bound(tmp_path, ray_session,
                                                                                         tiny_run):
    """Continuous rollouts with in-flight updates: every step trains, staleness stays within
    max_staleness, and no call was split across versions (each episode is one call here, so it
    spans one version)."""
    arm(tmp_path, kill_at=10**9)
    result = titanrl.train(_agent_config(tmp_path, tiny_run, continuous=True))
    steps = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["staleness/max"] <= 1 for m in steps)
    assert all(m["agent/versions_spanned_mean"] == 1.0 and m["agent/calls_per_episode"] == 1.0 for m in steps)
    assert all(m["parity/logprob_diff_max"] == 0.0 for m in steps)
