"""Runs that survive: bad rewards are contained, crashes save the last step, resume is exact to the bit.

These start real Ray actors with real vLLM engines on a tiny model; the killed run is a real
`titanrl train` process that receives SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from wandb_offline import history, offline_runs, offline_wandb_env, wandb_records

import titanrl
from titanrl.cli import load_config_file
from titanrl.config import apply_overrides
from titanrl.models.hf_checkpoint import load_model
from titanrl.rundir.checkpoints import list_checkpoints

CONFIG_FILE = '''
import math, random, time
import titanrl

def digit_share(prompt, completion, **fields):
    """Varies across samples of a random model; slow enough that a kill lands mid-run."""
    time.sleep({sleep})
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

def flaky(prompt, completion, **fields):
    """Raises on ~10 % and returns NaN on ~5 % of samples (CRC of the text: reproducible, unlike
    hash(), which each worker process salts differently)."""
    import zlib

    h = zlib.crc32(completion.encode()) % 100
    if h < 10:
        raise ValueError("grader crashed")
    if h < 15:
        return float("nan")
    return 0.0

config = titanrl.RunConfig(
    model=titanrl.ModelConfig(checkpoint={ckpt!r}),
    data=titanrl.DataConfig(train_file={train!r}, eval_file={eval!r}),
    rollout=titanrl.RolloutConfig(prompts_per_step=4, group_size=4, sampling=titanrl.SamplingConfig(max_new_tokens=6),
                                  engine=titanrl.EngineConfig(max_model_len=64)),
    train=titanrl.TrainConfig(steps={steps}, optimizer=titanrl.OptimizerConfig(lr=3e-3), max_staleness=1),
    eval=titanrl.EvalConfig(every_steps=3, correct_threshold=0.5),
    output=titanrl.OutputConfig(progress_bar=False, save_every_steps=2),
    rewards=[{rewards}],
    seed=3,
)
'''


def _write_config(tmp_path: Path, tiny_run, steps: int = 8, sleep: float = 0.0, rewards: str = "digit_share") -> Path:
    path = tmp_path / "config.py"
    path.write_text(CONFIG_FILE.format(ckpt=str(tiny_run.checkpoint), train=str(tiny_run.train_file),
                                       eval=str(tiny_run.eval_file(8)), steps=steps, sleep=sleep, rewards=rewards))
    return path


def _columns(metrics: list[dict], after: int) -> list[tuple]:
    return [(m["step"], m["loss"], m["reward/mean"], m["grad_norm"]) for m in metrics if m["step"] > after and "loss" in m]


RUN_STEPS = 6
"""Steps of the shared reference run and of the killed/resumed one (checkpoints every 2 steps: the
kill lands after step 2's or 4's, so the resumed attempt always has steps left to run)."""
RUN_REWARDS = "digit_share, flaky"


def _reference_config_file(tmp_path: Path, tiny_run) -> Path:
    """The config of the reference run and of the killed and resumed attempts (one file, one text)."""
    return _write_config(tmp_path, tiny_run, steps=RUN_STEPS, sleep=0.03, rewards=RUN_REWARDS)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, ray_session, tiny_run):
    """One uninterrupted run, shared by the resume test (its reference) and the contained-rewards test:
    `flaky` raises on ~10 % and returns NaN on ~5 % of samples, on top of `digit_share`."""
    folder = tmp_path_factory.mktemp("reference")
    config = apply_overrides(load_config_file(str(_reference_config_file(folder, tiny_run))),
                             [f"output.dir={folder / 'ref'}"])
    return config, titanrl.train(config)


@pytest.mark.slow
def test_sigkill_and_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, reference_run, tiny_run, monkeypatch):
    """A `titanrl train` process SIGKILLed after a checkpoint, then resumed, writes the same loss,
    reward/mean and grad_norm for every later step as an uninterrupted run, bit for bit; metrics.jsonl
    reads as one run and the killed attempt's rows are kept aside. max_staleness=1, so the
    checkpoint must carry rollouts of a policy that no longer exists; a reward that raises or
    returns NaN on some samples (`flaky`) is part of the run, so contained reward errors resume
    exactly too. The killed and resumed attempts mirror to one offline W&B run (the reference logs
    to none: W&B changes no number), and the resumed attempt's W&B history holds its steps with
    metrics.jsonl's values."""
    _, reference = reference_run
    offline_wandb_env(monkeypatch, tmp_path / "wandb-home")
    wandb = ["output.wandb_project=titanrl-tests", "output.wandb_mode=offline"]
    config_path = _reference_config_file(tmp_path, tiny_run)

    killed_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "titanrl.cli", "train", str(config_path), "--out", str(killed_dir),
         *(f"--{override}" for override in wandb)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not list_checkpoints(killed_dir):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (killed_dir / "final").exists(), "the run finished before the kill; make the reward slower"
    # Ray's per-node agents notice a dead raylet at once but spend 1-2 minutes trying to report
    # it to the (dead) GCS before exiting on their own; everything else must be gone promptly.
    left = _session_processes(proc.pid, ignore=("DashboardAgent", "RuntimeEnvAgent"))
    assert left == [], f"processes outlived their SIGKILLed driver: {left}"
    saved = list_checkpoints(killed_dir)[-1].step
    assert saved < RUN_STEPS

    resumed_config = apply_overrides(load_config_file(str(config_path)), [f"output.dir={killed_dir}", *wandb])
    resumed = titanrl.train(resumed_config, resume=True)
    killed_wandb, resumed_wandb = offline_runs(killed_dir)
    run_id = (killed_dir / "wandb_run_id.txt").read_text().strip()
    assert killed_wandb.name == resumed_wandb.name == f"run-{run_id}.wandb"
    assert [(row["step"], row["loss"]) for row in history(wandb_records(resumed_wandb))] == [
        (m["step"], m["loss"]) for m in resumed.metrics if m["step"] > saved]

    assert _columns(resumed.metrics, saved) == _columns(reference.metrics, saved)
    assert len(_columns(resumed.metrics, saved)) == RUN_STEPS - saved
    steps = [m["step"] for m in resumed.metrics if "loss" in m]
    assert steps == list(range(1, RUN_STEPS + 1)), "metrics.jsonl must read as one run"
    ref_model, _ = load_model(reference.final_checkpoint)
    res_model, _ = load_model(resumed.final_checkpoint)
    import torch

    assert all(torch.equal(a, b) for a, b in zip(ref_model.state_dict().values(), res_model.state_dict().values()))


@pytest.mark.slow
def test_rewards_that_raise_or_return_nan_are_contained(reference_run):
    """A reward raising on ~10 % and returning NaN on ~5 % of samples (the shared reference run's
    `flaky`): the run completes, counts the errors, keeps their text in rollouts.jsonl, never sees
    a NaN loss, and saves a loadable policy."""
    config, result = reference_run
    steps = [m for m in result.metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, RUN_STEPS + 1))
    assert sum(m["reward/errors"] for m in steps) > 0
    assert all(m["loss"] is not None and m["grad_norm"] is not None for m in steps)  # finite (None = NaN)
    rows = [json.loads(x) for x in (result.run_dir / "rollouts.jsonl").read_text().splitlines()]
    errors = [r["reward_error"] for r in rows if "reward_error" in r]
    assert any("grader crashed" in e for e in errors) and any("nan" in e for e in errors)
    assert all(r["reward"] == config.scoring.error_value for r in rows if "reward_error" in r)
    model, _ = load_model(result.final_checkpoint)
    assert model is not None


@pytest.mark.slow
def test_one_step_stale_pipeline(reference_run):
    """max_staleness=1 (the shared reference run, lock-step) overlaps generation with training and
    never trains on older data: step 1 trains on policy 0's rollouts, every later step s on
    policy s-2's (one version stale)."""
    _, result = reference_run
    steps = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, RUN_STEPS + 1))
    assert steps[0]["staleness/mean"] == 0.0
    assert all(m["staleness/mean"] == 1.0 for m in steps[1:])
    rollouts = [json.loads(line) for line in (result.run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert {(r["step"], r["policy_version"]) for r in rollouts} == {
        (1, 0), *((s, s - 2) for s in range(2, RUN_STEPS + 1))}


@pytest.mark.slow
def test_too_many_reward_errors_stop_the_run_with_a_checkpoint(tmp_path, ray_session, tiny_run):
    """A reward that always raises stops the run with a message quoting the error; a checkpoint
    is written and the actors are gone."""
    config_path = _write_config(tmp_path, tiny_run, steps=4)
    text = config_path.read_text().replace('time.sleep(', 'raise KeyError("no answer field"); time.sleep(')
    config_path.write_text(text)
    config = apply_overrides(load_config_file(str(config_path)), [f"output.dir={tmp_path / 'run'}"])
    with pytest.raises(titanrl.RunStopped, match="no answer field") as info:
        titanrl.train(config)
    assert "scoring.max_error_frac" in str(info.value)
    assert [c.step for c in list_checkpoints(tmp_path / "run")] == [0]
    assert _actor_processes() == []


def _session_processes(session_id: int, ignore: tuple[str, ...] = (), timeout_s: float = 30.0) -> list[str]:
    """Processes still in the session a run was started in (its Ray processes), after a grace period."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = subprocess.run(["pgrep", "-s", str(session_id)], capture_output=True, text=True).stdout.split()
        described = [subprocess.run(["ps", "-o", "args=", "-p", p], capture_output=True, text=True).stdout.strip()
                     for p in pids]
        described = [d for d in described if d and not any(name in d for name in ignore)]
        if not described or time.monotonic() > deadline:
            return described
        time.sleep(0.5)


def _actor_processes(timeout_s: float = 20.0) -> list[str]:
    """TitanRL actor processes still running (Ray names them ray::<Class>), after a grace period."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = subprocess.run(["pgrep", "-f", "ray::(RolloutWorker|GRPOTrainer)"], capture_output=True, text=True)
        pids = found.stdout.split()
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.5)


@pytest.mark.slow
def test_ctrl_c_saves_the_last_step_and_exits_nonzero(tmp_path, tiny_run):
    """SIGINT to `titanrl train` saves the last completed step, exits non-zero with a one-line
    reason, and leaves no process of the run behind (also where this test process itself
    ignores SIGINT, e.g. a background job: the child gets SIGINT at its default)."""
    returncode, err = _stop_a_run_with(tmp_path, tiny_run, signal.SIGINT)
    assert returncode != 0, err[-3000:]
    saved = list_checkpoints(tmp_path / "run")
    assert saved and saved[-1].step >= 1, err[-3000:]
    assert "interrupted" in saved[-1].manifest()["reason"]


@pytest.mark.slow
def test_sigterm_saves_the_last_step_shuts_down_and_exits_143(tmp_path, tiny_run):
    """SIGTERM (what SLURM, Kubernetes and `kill` send on preemption) does what Ctrl-C does: the
    last completed step is saved, no process of the run is left, and the exit status is 143
    (128 + SIGTERM, not an abort) with a one-line reason naming SIGTERM."""
    returncode, err = _stop_a_run_with(tmp_path, tiny_run, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = list_checkpoints(tmp_path / "run")
    assert saved and saved[-1].step >= 1, err[-3000:]
    assert saved[-1].manifest()["reason"] == "terminated (SIGTERM)"
    reasons = [line for line in err.splitlines() if "run stopped" in line]
    assert len(reasons) == 1 and "terminated (SIGTERM)" in reasons[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def _stop_a_run_with(tmp_path: Path, tiny_run, signum: int) -> tuple[int, str]:
    """Starts `titanrl train` (40 slow steps, no periodic checkpoints), sends `signum` once step 1
    is logged, waits for it to exit; returns its exit status and stderr. Checks that no process
    of the run outlived it."""
    config_path = _write_config(tmp_path, tiny_run, steps=40, sleep=0.03)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "titanrl.cli", "train", str(config_path), "--out", str(run_dir),
         "--output.save_every_steps=0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        # A background job inherits SIGINT ignored, and an ignored signal stays ignored across
        # exec: the child would never see the Ctrl-C this test sends.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 240  # a hang guard: start-up and one step take far less
        while not (run_dir / "metrics.jsonl").is_file() or "\"step\": 1" not in (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _session_processes(proc.pid) == [], "processes of the run outlived it"
    return proc.returncode, err.decode()
