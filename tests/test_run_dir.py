"""Run directories and their checkpoints: atomic writes, resume checks, rows set aside, overlong prompts."""

from __future__ import annotations

import dataclasses
import json

import pytest

import titanrl
from titanrl.config import ConfigError
from titanrl.data import DatasetError, drop_overlong, write_rows
from titanrl.rundir.checkpoints import (
    find_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    RunCheckpointError,
    writing_checkpoint,
)
from titanrl.config.record import config_record
from titanrl.rundir.layout import config_differences, create_run_dir, reopen_run_dir, set_aside_after


def _reward(prompt: str, completion: str, **fields) -> float:
    return 0.0


def _config(tmp_path, **output) -> titanrl.RunConfig:
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(tmp_path / "ckpt")),
        output=titanrl.OutputConfig(dir=str(tmp_path / "run"), **output),
        rewards=[_reward],
    )


def test_checkpoint_appears_only_when_complete(tmp_path):
    """An exception while writing leaves no checkpoint; a stray half-written directory is never listed."""
    with writing_checkpoint(tmp_path, 2, {"policy_version": 2}) as tmp:
        (tmp / "part").write_text("x")
    with pytest.raises(RuntimeError, match="disk full"):
        with writing_checkpoint(tmp_path, 4, {"policy_version": 4}) as tmp:
            (tmp / "part").write_text("half")
            raise RuntimeError("disk full")
    # What a SIGKILL mid-write leaves: a temporary directory, and a final-named one without manifest.
    (tmp_path / "checkpoints" / ".step_000006.tmp-999").mkdir()
    (tmp_path / "checkpoints" / "step_000008").mkdir()
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest.step == 2 and newest.manifest()["policy_version"] == 2
    assert (newest.path / "part").read_text() == "x"
    with pytest.raises(RunCheckpointError, match=r"steps with one: \[2\]"):
        find_checkpoint(tmp_path, 4)


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    """Writing the same step again swaps in the new content only once it is complete."""
    with writing_checkpoint(tmp_path, 3, {"v": 1}) as tmp:
        (tmp / "a").write_text("old")
    with writing_checkpoint(tmp_path, 3, {"v": 2}) as tmp:
        (tmp / "b").write_text("new")
    (only,) = list_checkpoints(tmp_path)
    assert only.manifest()["v"] == 2 and (only.path / "b").is_file() and not (only.path / "a").exists()


def test_resume_refuses_changed_config_naming_the_keys(tmp_path):
    """Resume accepts new step counts, output settings and trainer layouts, and refuses anything
    else, naming each key."""
    config = _config(tmp_path)
    run_dir = create_run_dir(config)
    with writing_checkpoint(run_dir, 5, {"policy_version": 5}):
        pass
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=500),
                                 output=dataclasses.replace(config.output, progress_bar=False))
    assert reopen_run_dir(longer)[1].step == 5
    relaid = dataclasses.replace(config, train=dataclasses.replace(
        config.train, parallel=dataclasses.replace(config.train.parallel, tp=2)))
    assert reopen_run_dir(relaid)[1].step == 5  # checkpoints reshard: the layout may change
    changed = dataclasses.replace(
        config,
        seed=7,
        train=dataclasses.replace(config.train, optimizer=dataclasses.replace(config.train.optimizer, lr=0.5)),
    )
    with pytest.raises(ConfigError) as info:
        reopen_run_dir(changed)
    assert "seed: 0 -> 7" in str(info.value) and "train.optimizer.lr: 0.0001 -> 0.5" in str(info.value)


def test_resume_needs_a_checkpoint(tmp_path):
    """A run directory without any complete checkpoint cannot be resumed, and the error says why."""
    config = _config(tmp_path)
    create_run_dir(config)
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        reopen_run_dir(config)
    with pytest.raises(ConfigError, match="holds no run"):
        reopen_run_dir(_config(tmp_path / "elsewhere"))


def test_create_refuses_an_existing_run_and_points_to_resume(tmp_path):
    """A directory that holds metrics.jsonl is refused and left untouched."""
    config = _config(tmp_path)
    run_dir = create_run_dir(config)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="--resume"):
        create_run_dir(config)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_config_record_round_trips_without_differences(tmp_path):
    """The record written to config.json compares equal to a fresh record of the same config."""
    config = _config(tmp_path)
    saved = json.loads(json.dumps(config_record(config)))
    assert config_differences(saved, config_record(config)) == []


def test_settings_added_since_the_run_was_saved_match_their_defaults(tmp_path):
    """A record saved before a setting existed resumes when the setting is at its default, and
    is refused when it is not (the saved run computed with the default)."""
    config = _config(tmp_path)
    saved = json.loads(json.dumps(config_record(config)))
    del saved["train"]["compute"]["pack_sequences"]  # as if written before train.compute.pack_sequences existed
    assert config_differences(saved, config_record(config)) == []
    changed = dataclasses.replace(
        config,
        train=dataclasses.replace(
            config.train, compute=dataclasses.replace(config.train.compute, pack_sequences=False)
        ),
    )
    assert config_differences(saved, config_record(changed)) == [("train.compute.pack_sequences", True, False)]


def test_a_record_saved_before_the_sections_resumes_under_the_new_names(tmp_path):
    """config.json of a run saved with flat keys (train.lr, reward_health.*) compares by the new
    keys: equal settings match, a changed one is named by its new key."""
    config = _config(tmp_path)
    saved = json.loads(json.dumps(config_record(config)))
    train = saved["train"]
    train["lr"] = train.pop("optimizer")["lr"]
    saved["reward_health"] = saved.pop("scoring")["health"]
    assert config_differences(saved, config_record(config)) == []
    train["lr"] = 0.5
    assert config_differences(saved, config_record(config)) == [("train.optimizer.lr", 0.5, config.train.optimizer.lr)]


def test_rows_after_the_checkpoint_are_set_aside(tmp_path):
    """metrics/rollouts rows of steps after the checkpoint move to *.before-resume; earlier rows stay."""
    rows = [{"step": s, "loss": s / 10} for s in range(0, 7)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # cut short by a SIGKILL
    write_rows(tmp_path / "rollouts.jsonl", [{"step": s} for s in (1, 4, 5)])
    moved = set_aside_after(tmp_path, 4)
    assert moved == {"metrics.jsonl": 3, "rollouts.jsonl": 1}
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2, 3, 4]
    aside = (tmp_path / "metrics.jsonl.before-resume").read_text().splitlines()
    assert len(aside) == 3 and aside[-1] == '{"step": 7, "lo'


def test_overlong_prompts_dropped_with_one_warning_or_refused():
    """Prompts that leave no room for max_new_tokens are dropped (count + first index) or refused."""
    rows = [{"prompt": "x" * n} for n in (3, 20, 5, 30, 8)]
    with pytest.warns(UserWarning, match=r"2 of 5 rows .* first is row 1 \(20 tokens\)"):
        kept = drop_overlong(rows, len, "prompt", max_new_tokens=6, max_model_len=16, source="t.jsonl")
    assert [len(r["prompt"]) for r in kept] == [3, 5, 8]
    with pytest.raises(DatasetError, match="on_overlong"):
        drop_overlong(rows, len, "prompt", 6, 16, "t.jsonl", on_overlong="error")
    with pytest.raises(DatasetError, match="no row is left"):
        drop_overlong(rows[1:2], len, "prompt", 6, 16, "t.jsonl")
    assert drop_overlong(rows, len, "prompt", 2, 64, "t.jsonl") is rows
