"""The loss settings of a TrainConfig with every per-loss default resolved (one place for them)."""

from __future__ import annotations

from dataclasses import dataclass

from titanrl.config.schema import TrainConfig

DAPO_CLIP_EPS_HIGH = 0.28
"""DAPO's clip-higher upper range, also CISPO's default weight truncation (1 + 0.28)."""

DEFAULT_AGGREGATION = {"gspo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
"""Aggregation of the losses whose papers define one other than token-mean."""


@dataclass(frozen=True)
class LossSettings:
    """What `GRPOStep._loss` computes, resolved from train.* fields."""

    loss: str
    """train.loss.objective."""
    aggregation: str
    """train.loss.aggregation, or the loss's own."""
    clip_low: float
    """Ratio clip below 1 (token ratio; gspo: sequence ratio; cispo: unused)."""
    clip_high: float
    """Ratio clip above 1 (cispo: the weight's truncation above 1)."""
    entropy_coef: float
    """train.loss.entropy_coef."""
    length_norm: int | None
    """train.loss.length_norm (seq-mean-token-sum-norm)."""
    correction: str
    """Off-policy correction ('none', 'tis_token', ...); decoupled_loss is 'tis_token'."""
    cap: float
    """Its upper ratio bound."""
    low: float
    """Its lower ratio bound (mis_*)."""
    scale_by_std: bool
    """Whether advantages are divided by their group's std."""

    @property
    def at_proximal(self) -> bool:
        """The policy ratio is taken around the trainer's batch-start weights, not the generator's."""
        return self.correction != "none"

    @property
    def sequence_level(self) -> bool:
        """Whether some quantity sums over a whole row (an all-reduce over cp ranks)."""
        return self.loss == "gspo" or self.correction in ("tis_sequence", "mis_sequence", "mis_geometric")


def loss_settings(cfg: TrainConfig) -> LossSettings:
    """`cfg`'s loss with each None resolved to the loss's own default."""
    if cfg.loss.objective == "gspo":
        low, high = cfg.loss.gspo_clip_eps
    else:
        default_high = DAPO_CLIP_EPS_HIGH if cfg.loss.objective in ("dapo", "cispo") else None
        high = cfg.loss.clip_eps_high if cfg.loss.clip_eps_high is not None else default_high
        low, high = cfg.loss.clip_eps, cfg.loss.clip_eps if high is None else high
    if cfg.off_policy.decoupled_loss and cfg.off_policy.correction == "none":
        correction, cap, lo = "tis_token", cfg.off_policy.behaviour_weight_cap, 0.0
    else:
        correction, cap = cfg.off_policy.correction, cfg.off_policy.cap
        lo = 1.0 / cap if cfg.off_policy.low is None else cfg.off_policy.low
    scale = (
        cfg.loss.objective != "dr_grpo"
        if cfg.loss.scale_advantages_by_std is None
        else cfg.loss.scale_advantages_by_std
    )
    return LossSettings(
        cfg.loss.objective,
        cfg.loss.aggregation or DEFAULT_AGGREGATION.get(cfg.loss.objective, "token-mean"),
        low,
        high,
        cfg.loss.entropy_coef,
        cfg.loss.length_norm,
        correction,
        cap,
        lo,
        scale,
    )
