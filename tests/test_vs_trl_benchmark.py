"""benchmarks/vs_trl.py's pure helpers: step-time extraction, tokens/s, the summary ratio, overrides.

Quick: nothing here imports TRL, starts Ray or vLLM, or trains.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(step: int, step_s: float, length: float = 64.0, **extra) -> dict:
    return {"step": step, "time/step_s": step_s, "completion/len_mean": length, **extra}


def test_median_after_warmup_drops_the_first_step(vs_trl):
    assert vs_trl.median_after_warmup([100.0, 2.0, 4.0, 3.0]) == 3.0
    assert vs_trl.median_after_warmup([100.0, 2.0, 4.0]) == 3.0  # even count: mean of the middle two
    assert vs_trl.median_after_warmup([5.0, 1.0], warmup=0) == 3.0


def test_median_after_warmup_refuses_when_nothing_is_left(vs_trl):
    with pytest.raises(ValueError, match="raise --steps"):
        vs_trl.median_after_warmup([7.0])


def test_titanrl_step_stats_reads_metrics_rows(vs_trl):
    rows = [
        {"step": 0, "eval/accuracy": 0.1},  # an eval-only row before step 1
        _row(2, 6.0, 60.0, **{"time/train_s": 3.0, "time/gen_s": 5.0}),
        _row(1, 20.0, 10.0, **{"time/train_s": 9.0, "time/gen_s": 11.0}),  # out of order: sorted by step
        _row(3, 8.0, 62.0, **{"time/train_s": 4.0, "time/gen_s": 7.0}),
    ]
    stats = vs_trl.titanrl_step_stats(rows)
    assert stats["step_s"] == 7.0
    assert stats["step_times_s"] == [20.0, 6.0, 8.0]
    assert stats["measured_steps"] == 2
    assert stats["completion_len_mean"] == 61.0  # the warm-up step's length is left out too
    assert stats["train_s"] == 3.5
    assert stats["gen_s"] == 6.0


def test_titanrl_step_stats_leaves_out_missing_timings(vs_trl):
    stats = vs_trl.titanrl_step_stats([_row(1, 9.0), _row(2, 5.0, **{"time/train_s": 2.0}), _row(3, 7.0)])
    assert stats["step_s"] == 6.0
    assert "train_s" not in stats and "gen_s" not in stats


def test_trl_step_stats(vs_trl):
    stats = vs_trl.trl_step_stats([30.0, 6.0, 7.0, 8.0], [40.0, 63.0, 64.0, 62.0])
    assert stats["step_s"] == 7.0
    assert stats["measured_steps"] == 3
    assert stats["completion_len_mean"] == 63.0
    assert vs_trl.trl_step_stats([3.0, 2.0], [])["completion_len_mean"] is None


def test_tokens_per_s(vs_trl):
    assert vs_trl.tokens_per_s(64.0, 64, 2.0) == 2048.0
    assert vs_trl.tokens_per_s(32.0, 64, 4.0) == 512.0


def _run(arm: str, repeat: int, step_s: float, tok_s: float, length: float = 64.0) -> dict:
    return {"arm": arm, "repeat": repeat, "step_s": step_s, "tokens_per_s": tok_s, "completion_len_mean": length}


def test_summarize_ratio_is_trl_time_over_titanrl_time(vs_trl):
    results = [
        _run("titanrl", 0, 4.0, 1000.0, 60.0), _run("trl", 0, 6.0, 700.0, 62.0),
        _run("titanrl", 1, 5.0, 800.0, 62.0), _run("trl", 1, 6.5, 650.0, 64.0),
        _run("titanrl", 2, 6.0, 900.0, 64.0), _run("trl", 2, 9.0, 600.0, 63.0),
    ]
    summary = vs_trl.summarize(results)
    assert summary["titanrl_step_s"] == 5.0 and summary["trl_step_s"] == 6.5
    assert summary["ratio_titanrl_over_trl_speed"] == 1.3  # 6.5 / 5.0: > 1, TitanRL faster
    assert summary["per_repeat_ratios"] == [1.5, 1.3, 1.5]
    assert summary["ratio_tokens_per_s"] == round(900.0 / 650.0, 3)
    assert summary["titanrl_completion_len_mean"] == 62.0 and summary["trl_completion_len_mean"] == 63.0
    assert summary["meets_issue_target"] is False


def test_summarize_slower_titanrl_is_below_one_and_target(vs_trl):
    summary = vs_trl.summarize([_run("titanrl", 0, 7.5, 500.0), _run("trl", 0, 6.16, 600.0)])
    assert summary["ratio_titanrl_over_trl_speed"] == round(6.16 / 7.5, 3) < 1
    fast = vs_trl.summarize([_run("titanrl", 0, 4.0, 500.0), _run("trl", 0, 6.0, 600.0)])
    assert fast["ratio_titanrl_over_trl_speed"] == 1.5 and fast["meets_issue_target"] is True


def test_summarize_needs_both_arms(vs_trl):
    with pytest.raises(ValueError, match="titanrl and one trl"):
        vs_trl.summarize([_run("titanrl", 0, 4.0, 500.0)])


def test_titanrl_overrides_set_the_workload_and_extras_win(vs_trl):
    overrides = vs_trl.titanrl_overrides(
        "/ck", 5, 2, "/out", ["train.compute.share_prompts=false", "train.compute.threads=1"]
    )
    assert "model.checkpoint=/ck" in overrides
    assert "rollout.prompts_per_step=8" in overrides and "rollout.group_size=8" in overrides
    assert "rollout.sampling.max_new_tokens=64" in overrides and "train.max_staleness=1" in overrides
    assert "train.steps=5" in overrides and "output.dir=/out" in overrides
    assert overrides[-2:] == [
        "train.compute.share_prompts=false",
        "train.compute.threads=1",
    ]  # after train.compute.threads=2


def test_titanrl_overrides_build_a_valid_config(vs_trl):
    from titanrl.cli import load_config_file
    from titanrl.config import apply_overrides

    config = apply_overrides(load_config_file(str(vs_trl.EXAMPLE_CONFIG)),
                             vs_trl.titanrl_overrides("/ck", 3, 2, "/out", ["train.compute.share_prompts=false"]))
    assert config.rollout.prompts_per_step * config.rollout.group_size == 64
    assert config.rollout.sampling.max_new_tokens == 64 < config.rollout.engine.max_model_len
    assert config.train.max_staleness == 1 and config.train.compute.threads == 2
    assert config.train.compute.share_prompts is False and config.eval.every_steps == 0


def test_trl_reward_is_the_example_reward(vs_trl):
    assert vs_trl.trl_reward(["1+2=", "5+5="], ["3", " 11"], answer=["3", "10"], extra="ignored") == [1.0, 0.0]


def test_parse_args_refuses_too_few_steps(vs_trl):
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--steps", "1"])
    args = vs_trl.parse_args(["--steps", "3", "--titanrl-overrides", "train.compute.share_prompts=false"])
    assert args.titanrl_overrides == ["train.compute.share_prompts=false"] and args.arms == ["titanrl", "trl"]
