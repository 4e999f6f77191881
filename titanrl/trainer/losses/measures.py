"""What the loss clips, masks or truncates: sums and maxima over micro-batches, ranks and passes,
and the metrics made from them."""

from __future__ import annotations

import math

import torch

from titanrl.trainer.losses.off_policy import EXTREMES, MEASURES
from titanrl.trainer.losses.settings import LossSettings


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class LossMeasures:
    """Named sums (token or sequence counts) and maxima of one rank's micro-batches."""

    def __init__(self, s: LossSettings) -> None:
        sums = ["clip_low_tokens", "clip_high_tokens"]
        if s.loss == "gspo":
            sums += ["clipped_sequences", "sequences"]
        maxima: list[str] = []
        if s.at_proximal:
            sums += MEASURES
            maxima += EXTREMES
        self.sums = dict.fromkeys(sums, 0.0)
        self.maxima = dict.fromkeys(maxima, float("-inf"))

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        """One micro-batch's stats (every name of this loss must be in them)."""
        for k in self.sums:
            self.sums[k] += stats[k].item()
        for k in self.maxima:
            self.maxima[k] = _nan_max(self.maxima[k], stats[k].item())

    def merge(self, other: LossMeasures) -> None:
        for k in self.sums:
            self.sums[k] += other.sums[k]
        for k in self.maxima:
            self.maxima[k] = _nan_max(self.maxima[k], other.maxima[k])


def combine_passes(passes: list[dict[str, float]]) -> dict[str, float]:
    """The measures of several gradient passes (GradStats.loss_measures): sums add, maxima max."""
    out: dict[str, float] = {}
    for measures in passes:
        for k, v in measures.items():
            if k not in out:
                out[k] = v
            else:
                out[k] = _nan_max(out[k], v) if k in EXTREMES else out[k] + v
    return out


def loss_metrics(s: LossSettings, m: dict[str, float], tokens: float) -> dict[str, float]:
    """Metrics of `combine_passes`' result over `tokens` trained tokens (the same passes).

    loss/clip_low_fraction, loss/clip_high_fraction: tokens whose ratio was clipped below / above
      (gspo: tokens of sequences clipped; cispo: high is the weight truncation, low is 0); their
      sum is train/clip_fraction.
    loss/clip_seq_fraction (gspo): sequences whose ratio was clipped.
    loss/clip_weight_fraction (cispo): tokens whose weight was truncated.
    offpolicy/ratio_mean, _max, _min: pi_trainer / pi_generator per trained token (with an
      off-policy correction or decoupled_loss); offpolicy/weight_mean: the weight applied;
      offpolicy/clipped_fraction: tokens truncated (tis_*); offpolicy/masked_fraction: dropped (mis_*).
    """
    if not m:
        return {}
    tokens = max(tokens, 1.0)
    out = {"loss/clip_low_fraction": m["clip_low_tokens"] / tokens,
           "loss/clip_high_fraction": m["clip_high_tokens"] / tokens}
    if s.loss == "gspo":
        out["loss/clip_seq_fraction"] = m["clipped_sequences"] / max(m["sequences"], 1e-12)
    if s.loss == "cispo":
        out["loss/clip_weight_fraction"] = m["clip_high_tokens"] / tokens
    if s.at_proximal:
        out.update({
            "offpolicy/ratio_mean": m["offpolicy_ratio_sum"] / tokens,
            "offpolicy/ratio_max": m["offpolicy_ratio_max"],
            "offpolicy/ratio_min": -m["offpolicy_ratio_neg_min"],
            "offpolicy/weight_mean": m["offpolicy_weight_sum"] / tokens,
            "offpolicy/clipped_fraction": m["offpolicy_clipped_tokens"] / tokens,
            "offpolicy/masked_fraction": m["offpolicy_masked_tokens"] / tokens,
        })
    return out
