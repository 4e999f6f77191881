"""Run-directory logging: metrics.jsonl, TensorBoard events, rollouts.jsonl, the final plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from titanrl.jsonl import read_json_lines


class MetricsLogger:
    """Appends one JSON object per step and flushes it, so a crash loses at most one line."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")
        self._rollouts = open(self.run_dir / "rollouts.jsonl", "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        if self._tb is not None:
            step = int(record["step"])
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._rollouts.write(json.dumps({"step": step, **row}) + "\n")
        self._rollouts.flush()

    def close(self) -> None:
        self._metrics.close()
        self._rollouts.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` (read by `titanrl.jsonl`'s rule for a crash's cut-short line)."""
    return read_json_lines(Path(run_dir) / "metrics.jsonl").values()


def plot_run(run_dir: str | Path) -> Path:
    """Draws reward mean and eval accuracy against step into `run_dir/progress.png`; for
    environment runs a panel shows tool calls, errors (per step) and turns per episode, and for
    mixture-of-experts policies one shows trainer/generator route agreement and expert load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)

    def series(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in records if r.get(key) is not None]

    has_env = bool(series("env/turns_mean"))
    has_moe = bool(series("moe/route_agreement"))
    panels = 1 + has_env + has_moe
    fig, axes = plt.subplots(panels, 1, figsize=(7, 4 + 2.5 * (panels - 1)), dpi=110, sharex=True, squeeze=False)
    ax = axes[0][0]
    train, evals = series("reward/mean"), series("eval/accuracy")
    if train:
        ax.plot(*zip(*train), label="train reward (mean)", color="tab:blue", alpha=0.8)
    if evals:
        ax.plot(*zip(*evals), label="eval accuracy (greedy)", color="tab:orange", marker="o")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(Path(run_dir).name)
    if has_env:
        env_ax = axes[1][0]
        for key, label, color in (("env/tool_calls", "tool calls / step", "tab:green"),
                                  ("env/errors", "errors / step", "tab:red")):
            if series(key):
                env_ax.plot(*zip(*series(key)), label=label, color=color, alpha=0.8)
        env_ax.set_ylabel("per step")
        env_ax.grid(alpha=0.3)
        turns_ax = env_ax.twinx()
        turns_ax.plot(*zip(*series("env/turns_mean")), label="turns / episode", color="tab:purple", linestyle="--")
        turns_ax.set_ylabel("turns / episode")
        lines = env_ax.get_legend_handles_labels()[0] + turns_ax.get_legend_handles_labels()[0]
        env_ax.legend(lines, [line.get_label() for line in lines], loc="center right")
    if has_moe:
        moe_ax = axes[-1][0]
        for key, label, color in (("moe/route_agreement", "route agreement (live top-k)", "tab:blue"),
                                  ("moe/route_agreement_used", "route agreement (experts used)", "tab:cyan")):
            if series(key):
                moe_ax.plot(*zip(*series(key)), label=label, color=color, alpha=0.8)
        moe_ax.set_ylim(-0.02, 1.02)
        moe_ax.set_ylabel("trainer vs generator")
        moe_ax.grid(alpha=0.3)
        load_ax = moe_ax.twinx()
        if series("moe/load_max_over_mean"):
            load_ax.plot(*zip(*series("moe/load_max_over_mean")), label="expert load max / mean",
                         color="tab:red", linestyle="--")
        load_ax.set_ylabel("load max / mean")
        lines = moe_ax.get_legend_handles_labels()[0] + load_ax.get_legend_handles_labels()[0]
        moe_ax.legend(lines, [line.get_label() for line in lines], loc="lower left")
    axes[-1][0].set_xlabel("step")
    out = Path(run_dir) / "progress.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
