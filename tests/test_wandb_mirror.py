"""Weights & Biases mirror of metrics.jsonl (`output.wandb_project`): offline runs only, no network.

What W&B received is read back from the offline run's `.wandb` file (`wandb_offline`).
"""

from __future__ import annotations

import logging
import sys

import pytest
from wandb_offline import config_updates, history, offline_runs, offline_wandb_env, wandb_records

from titanrl.config import ConfigError, OutputConfig, RunConfig, validate
from titanrl.rundir.metrics import MetricsLogger, read_metrics
from titanrl.rundir.wandb_mirror import RUN_ID_FILE, WandbMirror


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    offline_wandb_env(monkeypatch, tmp_path / "wandb-home")


@pytest.fixture
def warnings_of_titanrl():
    """The "titanrl" logger's warnings (it may not propagate to the root logger, see driver.log)."""
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler, logger = Collect(), logging.getLogger("titanrl")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


OFFLINE = OutputConfig(wandb_project="titanrl-tests", wandb_mode="offline")


def test_offline_wandb_run_receives_every_step_and_the_config(tmp_path):
    """Each record MetricsLogger writes reaches the offline W&B run under RUN_DIR/wandb/ as one history
    row against its step (the numbers only, as TensorBoard gets them), and the config is logged once."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mirror = WandbMirror.start(OFFLINE, run_dir, {"train": {"lr": 0.125}, "rewards": ["m:f"]})
    assert mirror is not None
    logger = MetricsLogger(run_dir, tensorboard=False, wandb=mirror)
    logged = [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5, "loss": -0.125, "kl/mean": 0.01, "note": "x", "flag": True, "gap": None},
        {"step": 2, "reward/mean": 0.75, "loss": 0.0625, "eval/accuracy": 0.5},
    ]
    for record in logged:
        logger.log(record)
    logger.close()
    assert read_metrics(run_dir) == logged  # the run directory still has everything
    [offline] = offline_runs(run_dir)
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert offline.name == f"run-{run_id}.wandb"
    records = wandb_records(offline)
    assert history(records) == [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5, "loss": -0.125, "kl/mean": 0.01},
        {"step": 2, "reward/mean": 0.75, "loss": 0.0625, "eval/accuracy": 0.5},
    ]
    assert config_updates(records) == {"train": {"lr": 0.125}, "rewards": ["m:f"]}
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "titanrl-tests", "run")


def test_resume_continues_the_same_wandb_run(tmp_path):
    """A second start in the same run directory (what --resume does) logs to the W&B run id kept in
    RUN_DIR/wandb_run_id.txt: both offline runs carry that id, the second has the resumed steps."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for steps in ((1, 2), (2, 3)):  # the resumed attempt writes step 2 again (set_aside_after)
        logger = MetricsLogger(run_dir, tensorboard=False, wandb=WandbMirror.start(OFFLINE, run_dir, {}))
        for step in steps:
            logger.log({"step": step, "loss": float(step)})
        logger.close()
    first, second = offline_runs(run_dir)
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert first.name == second.name == f"run-{run_id}.wandb"
    assert [row["step"] for row in history(wandb_records(second))] == [2, 3]


def test_wandb_start_failure_warns_once_and_the_run_goes_on(tmp_path, warnings_of_titanrl):
    """wandb.init refusing to start (here: a run id file W&B rejects) gives one warning and no mirror;
    the metrics still land in metrics.jsonl."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_ID_FILE).write_text("not/a:valid#id\n")
    mirror = WandbMirror.start(OFFLINE, run_dir, {})
    assert mirror is None
    logger = MetricsLogger(run_dir, tensorboard=False, wandb=mirror)
    for step in (1, 2):
        logger.log({"step": step, "loss": 1.0})
    logger.close(failed=True)
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert len(warnings_of_titanrl) == 1 and "W&B start failed" in warnings_of_titanrl[0]
    assert offline_runs(run_dir) == []


def test_wandb_failure_mid_run_warns_once_and_logging_goes_on(tmp_path, warnings_of_titanrl):
    """The W&B service going away mid-run (wandb.teardown) makes the next log fail: one warning,
    W&B is off afterwards, and every step is still written to metrics.jsonl."""
    import wandb

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logger = MetricsLogger(run_dir, tensorboard=False, wandb=WandbMirror.start(OFFLINE, run_dir, {}))
    logger.log({"step": 1, "loss": 1.0})
    wandb.teardown()
    for step in (2, 3, 4):
        logger.log({"step": step, "loss": 1.0})
    logger.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert len(warnings_of_titanrl) == 1 and "W&B log failed" in warnings_of_titanrl[0]


def test_wandb_off_or_disabled_starts_nothing(tmp_path):
    """No project, or wandb_mode='disabled': no mirror, no W&B files, no run id file."""
    for output in (OutputConfig(), OutputConfig(wandb_project="p", wandb_mode="disabled")):
        assert WandbMirror.start(output, tmp_path, {}) is None
    assert not (tmp_path / "wandb").exists() and not (tmp_path / RUN_ID_FILE).exists()


def test_validation_refuses_wandb_project_without_the_package(monkeypatch):
    """output.wandb_project with wandb not importable is a ConfigError naming the field and the extra;
    with wandb importable validation goes past it (to the next problem of this bare config)."""
    config = RunConfig(output=OutputConfig(wandb_project="p"))
    with pytest.raises(ConfigError) as present:
        validate(config)
    assert "wandb" not in str(present.value)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"output.wandb_project='p' needs the wandb package.*titanrl\[wandb\]"):
        validate(config)
    validate_off = RunConfig(output=OutputConfig(wandb_project="p", wandb_mode="disabled"))
    with pytest.raises(ConfigError) as disabled:
        validate(validate_off)
    assert "wandb" not in str(disabled.value)
