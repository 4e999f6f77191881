"""progress.png: panels chosen from the metrics metrics.jsonl holds, and the PNG drawn from them."""

from __future__ import annotations

from PIL import Image

from titanrl.rundir.metrics import MetricsLogger
from titanrl.rundir.progress import choose_panels, logged_scalars, plot_run

TODAY = {
    # What a dense single-turn run logs today (driver/loop.py, rundir/rollout_log.py, trainer/trainer.py).
    "step", "loss", "grad_norm", "lr", "policy_version", "reward/mean", "reward/errors", "reward/std",
    "reward/group_any_positive_frac", "completion/len_mean", "completion/truncated_frac", "train/clip_fraction",
    "train/entropy", "train/mismatch_mean_abs", "train/mismatch_max_abs", "train/tokens", "time/train_s",
    "parity/logprob_diff_max", "parity/logprob_diff_mean", "parity/tokens_checked", "throughput/gen_tokens_per_s",
    "eval/accuracy", "eval/reward_mean", "time/step_s", "staleness/mean",
}


def drawn(keys):
    return {plan.panel.title: plan.keys + plan.twin_keys + [r.label for r in plan.ratios]
            for plan in choose_panels(keys)}


def write_run(run_dir, records):
    logger = MetricsLogger(run_dir, tensorboard=False)
    for record in records:
        logger.log(record)
    logger.close()


def test_panels_of_the_metrics_logged_today():
    """Today's metric names give the reward, entropy, length, clip, parity and throughput panels, each
    with exactly these keys; KL, environment and MoE panels are left out (nothing of theirs is logged)."""
    assert drawn(TODAY) == {
        "reward": ["reward/mean", "eval/accuracy"],
        "entropy": ["train/entropy"],
        "response length": ["completion/len_mean"],
        "clip fractions": ["train/clip_fraction"],
        "trainer vs generator logprobs": ["parity/logprob_diff_max", "parity/logprob_diff_mean"],
        "throughput": ["throughput/gen_tokens_per_s", "train/tokens / time/train_s"],
    }


def test_new_metric_names_join_their_panels_by_prefix():
    """Metrics other parts add (KL, clip variants, per-reward means, a bare entropy) show up in their
    panel with no change to progress.py; a reward's error count does not join the reward panel."""
    new = {"kl/mean", "loss/clip_fraction", "loss/clip_high_fraction", "reward/format/mean", "reward/format/errors",
           "reward/math/mean", "entropy"}
    panels = drawn(TODAY | new)
    assert panels["KL to the reference policy"] == ["kl/mean"]
    assert panels["clip fractions"] == ["train/clip_fraction", "loss/clip_fraction", "loss/clip_high_fraction"]
    assert panels["reward"] == ["reward/mean", "reward/format/mean", "reward/math/mean", "eval/accuracy"]
    assert panels["entropy"] == ["entropy", "train/entropy"]
    assert not any("reward/format/errors" in keys for keys in panels.values())


def test_env_and_moe_panels_with_their_twin_axes():
    """Environment and MoE metrics get their panels, the turns and the expert load on the right axis."""
    plans = {p.panel.title: p for p in choose_panels({"reward/mean", "env/tool_calls", "env/errors", "env/turns_mean",
                                                      "moe/route_agreement", "moe/load_max_over_mean"})}
    assert list(plans) == ["reward", "environment", "MoE routing"]
    assert (plans["environment"].keys, plans["environment"].twin_keys) == (["env/tool_calls", "env/errors"],
                                                                           ["env/turns_mean"])
    assert (plans["MoE routing"].keys, plans["MoE routing"].twin_keys) == (["moe/route_agreement"],
                                                                           ["moe/load_max_over_mean"])


def test_a_ratio_needs_both_of_its_metrics():
    """The trainer's tokens/s is drawn only when train/tokens and time/train_s are both logged."""
    assert "throughput" not in drawn({"train/tokens"})
    assert drawn({"train/tokens", "time/train_s"}) == {"throughput": ["train/tokens / time/train_s"]}


def test_only_numbers_count_as_logged():
    """A metric that was only ever None (non-finite on disk), a string or a flag has nothing to draw."""
    records = [{"step": 1, "kl/mean": None, "note": "x", "flag": True, "reward/mean": 0.5},
               {"step": 2, "kl/mean": None, "reward/mean": float("nan"), "loss": 1}]
    assert logged_scalars(records) == {"step", "reward/mean", "loss"}


def test_plot_run_writes_png(tmp_path):
    """plot_run draws metrics.jsonl (train reward and eval accuracy) into a non-empty PNG."""
    write_run(tmp_path, [{"step": 0, "eval/accuracy": 0.1}]
              + [{"step": s, "reward/mean": s / 10, "eval/accuracy": None} for s in range(1, 6)]
              + [{"step": 5, "eval/accuracy": 0.4}])
    out = plot_run(tmp_path)
    assert out == tmp_path / "progress.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_run_draws_a_panel_per_kind_of_metric(tmp_path):
    """A run logging today's metrics plus KL gets a PNG with more panels (taller and, past three panels,
    two columns wide) than a run logging only the reward; metrics missing from some steps are fine."""
    reward_only, full = tmp_path / "reward_only", tmp_path / "full"
    write_run(reward_only, [{"step": s, "reward/mean": s / 10} for s in range(1, 4)])
    write_run(full, [{**{k: 0.1 * s for k in TODAY if k != "step"}, "step": s, "kl/mean": None if s == 2 else 0.01}
                     for s in range(1, 4)])
    small, big = (Image.open(plot_run(run)).size for run in (reward_only, full))
    assert big[0] > small[0] and big[1] > small[1]


def test_plot_run_adds_an_env_panel_for_episodes(tmp_path):
    """Runs with an environment get a second panel (tool calls, errors, turns): the PNG is taller
    than a single-turn run's, and a run without env metrics keeps the one-panel size."""
    single, env = tmp_path / "single", tmp_path / "env"
    for run_dir, extra in ((single, {}), (env, {"env/tool_calls": 3.0, "env/errors": 1.0, "env/turns_mean": 1.5})):
        write_run(run_dir, [{"step": s, "reward/mean": s / 10, **extra} for s in range(1, 4)])
    heights = [Image.open(plot_run(run_dir)).size[1] for run_dir in (single, env)]
    assert heights[1] > heights[0]


def test_plot_run_adds_a_moe_panel_for_routing_metrics(tmp_path):
    """An MoE run (moe/route_agreement logged) gets a routing panel: the PNG is taller than the same
    run's without routing metrics, with and without the environment panel."""
    moe = {"moe/route_agreement": 0.98, "moe/route_agreement_used": 1.0, "moe/load_max_over_mean": 2.5}
    env = {"env/tool_calls": 3.0, "env/errors": 1.0, "env/turns_mean": 1.5}
    heights = {}
    for name, extra in (("plain", {}), ("moe", moe), ("env", env), ("env_moe", {**env, **moe})):
        write_run(tmp_path / name, [{"step": s, "reward/mean": s / 10, **extra} for s in range(1, 4)])
        heights[name] = Image.open(plot_run(tmp_path / name)).size[1]
    assert heights["moe"] > heights["plain"] and heights["env_moe"] > heights["env"]


def test_plot_run_with_nothing_to_draw_still_writes_a_png(tmp_path):
    """A run whose only record holds no number yet (a step with every metric None) gets a PNG saying so."""
    write_run(tmp_path, [{"step": 0, "eval/accuracy": None}])
    assert plot_run(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
