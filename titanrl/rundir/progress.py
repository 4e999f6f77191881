"""progress.png: one panel per kind of metric that metrics.jsonl holds, against step.

Panels name their metrics by glob patterns (`fnmatch`), so a metric that a new loss, reward or
estimator logs under an existing prefix (`kl/...`, `loss/clip...`, `reward/<name>/mean`) shows
up without a change here. A panel none of whose patterns matches a logged metric is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from titanrl.rundir.metrics import read_metrics


@dataclass(frozen=True)
class Ratio:
    """A series drawn as one metric divided by another of the same step (e.g. tokens / seconds)."""

    numerator: str
    denominator: str

    @property
    def label(self) -> str:
        return f"{self.numerator} / {self.denominator}"


@dataclass(frozen=True)
class Panel:
    """One plot: the metrics matching `keys` on its left axis, those matching `twin_keys` on its right."""

    title: str
    keys: tuple[str, ...]
    ylabel: str
    twin_keys: tuple[str, ...] = ()
    twin_ylabel: str = ""
    ratios: tuple[Ratio, ...] = ()


PANELS: tuple[Panel, ...] = (
    Panel("reward", ("reward/mean", "reward/*/mean", "eval/accuracy"), "reward / accuracy"),
    Panel("KL to the reference policy", ("kl/*",), "KL"),
    Panel("entropy", ("entropy", "entropy/*", "*/entropy"), "nats / token"),
    Panel("response length", ("completion/len*",), "tokens"),
    Panel("clip fractions", ("train/clip*", "loss/clip*"), "fraction of tokens"),
    Panel("trainer vs generator logprobs", ("parity/logprob_diff_*",), "|logprob difference|"),
    Panel("off-policy correction", ("offpolicy/ratio_*", "offpolicy/weight_*"), "pi_trainer / pi_generator",
          ("offpolicy/clipped_fraction", "offpolicy/masked_fraction"), "fraction of tokens"),
    Panel("throughput", ("throughput/*",), "tokens / s", ratios=(Ratio("train/tokens", "time/train_s"),)),
    Panel("environment", ("env/tool_calls", "env/errors"), "per step", ("env/turns_mean",), "turns / episode"),
    Panel("MoE routing", ("moe/route_agreement", "moe/route_agreement_used"), "trainer vs generator",
          ("moe/load_max_over_mean",), "expert load max / mean"),
)
"""What progress.png can show, in drawing order."""


@dataclass
class PanelPlan:
    """A panel to draw and the logged metrics it draws."""

    panel: Panel
    keys: list[str] = field(default_factory=list)
    twin_keys: list[str] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)


def choose_panels(logged: Iterable[str], panels: tuple[Panel, ...] = PANELS) -> list[PanelPlan]:
    """The panels that have something to draw among the `logged` metric names, each with its
    matching names (in pattern order, sorted within a pattern); a name is drawn in one panel only."""
    names = sorted(set(logged) - {"step"})
    taken: set[str] = set()

    def matching(patterns: tuple[str, ...]) -> list[str]:
        found = []
        for pattern in patterns:
            for name in names:
                if name not in taken and fnmatchcase(name, pattern):
                    taken.add(name)
                    found.append(name)
        return found

    plans = []
    for panel in panels:
        plan = PanelPlan(panel, matching(panel.keys), matching(panel.twin_keys),
                         [r for r in panel.ratios if r.numerator in names and r.denominator in names])
        if plan.keys or plan.twin_keys or plan.ratios:
            plans.append(plan)
    return plans


def logged_scalars(records: list[dict[str, Any]]) -> set[str]:
    """Names with at least one finite number among `records` (None, strings and flags do not count)."""
    return {k for r in records for k, v in r.items() if _number(v) is not None}


def plot_run(run_dir: str | Path) -> Path:
    """Draws `run_dir/progress.png` from its metrics.jsonl: the panels of `choose_panels`, against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    plans = choose_panels(logged_scalars(records))
    cols = 1 if len(plans) <= 3 else 2
    rows = max(1, math.ceil(len(plans) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 1.5 + 2.5 * rows), dpi=110, sharex=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, plan in zip(flat, plans):
        _draw(ax, plan, records)
    for ax in flat[len(plans):]:
        ax.set_visible(False)
    if not plans:
        flat[0].set_visible(True)
        flat[0].text(0.5, 0.5, "no metrics logged yet", ha="center", va="center", transform=flat[0].transAxes)
    for index, ax in enumerate(flat[:max(1, len(plans))]):
        if index + cols >= max(1, len(plans)):  # the lowest panel of its column
            ax.set_xlabel("step")
            ax.xaxis.set_tick_params(labelbottom=True)
    fig.suptitle(Path(run_dir).name)
    out = Path(run_dir) / "progress.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _draw(ax: Any, plan: PanelPlan, records: list[dict[str, Any]]) -> None:
    colors = (f"C{i % 10}" for i in range(len(plan.keys) + len(plan.ratios) + len(plan.twin_keys)))
    for key in plan.keys:
        _line(ax, key, [(r["step"], _number(r.get(key))) for r in records], next(colors))
    for ratio in plan.ratios:
        points = []
        for r in records:
            top, bottom = _number(r.get(ratio.numerator)), _number(r.get(ratio.denominator))
            points.append((r["step"], top / bottom if top is not None and bottom else None))
        _line(ax, ratio.label, points, next(colors))
    ax.set_title(plan.panel.title, fontsize=10)
    ax.set_ylabel(plan.panel.ylabel)
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()[0]
    if plan.twin_keys:
        twin = ax.twinx()
        for key in plan.twin_keys:
            _line(twin, key, [(r["step"], _number(r.get(key))) for r in records], next(colors), linestyle="--")
        twin.set_ylabel(plan.panel.twin_ylabel)
        lines += twin.get_legend_handles_labels()[0]
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="best")


def _line(ax: Any, label: str, points: list[tuple[int, float | None]], color: str, linestyle: str = "-") -> None:
    points = [(step, value) for step, value in points if value is not None]
    if not points:
        return
    # Evaluations (every eval.every_steps) and single points need markers to be seen.
    marker = "o" if label.startswith("eval/") or len(points) == 1 else None
    ax.plot(*zip(*points), label=label, color=color, marker=marker, linestyle=linestyle, alpha=0.85)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
