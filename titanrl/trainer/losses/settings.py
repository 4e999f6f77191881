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
    """train.loss."""
    aggregation: str
    """train.loss_aggregation, or the loss's own."""
    clip_low: float
    """Ratio clip below 1 (token ratio; gspo: sequence ratio; cispo: unused)."""
    clip_high: float
    """Ratio clip above 1 (cispo: the weight's truncation above 1)."""
    entropy_coef: float
    """train.entropy_coef."""
    length_norm: int | None
    """train.loss_length_norm (seq-mean-token-sum-norm)."""
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
    if cfg.loss == "gspo":
        low, high = cfg.gspo_clip_eps
    else:
        default_high = DAPO_CLIP_EPS_HIGH if cfg.loss in ("dapo", "cispo") else None
        high = cfg.clip_eps_high if cfg.clip_eps_high is not None else default_high
        low, high = cfg.clip_eps, cfg.clip_eps if high is None else high
    if cfg.decoupled_loss and cfg.off_policy_correction == "none":
        correction, cap, lo = "tis_token", cfg.behaviour_weight_cap, 0.0
    else:
        correction, cap = cfg.off_policy_correction, cfg.off_policy_cap
        lo = 1.0 / cap if cfg.off_policy_low is None else cfg.off_policy_low
    scale = cfg.loss != "dr_grpo" if cfg.scale_advantages_by_std is None else cfg.scale_advantages_by_std
    return LossSettings(cfg.loss, cfg.loss_aggregation or DEFAULT_AGGREGATION.get(cfg.loss, "token-mean"),
                        low, high, cfg.entropy_coef, cfg.loss_length_norm, correction, cap, lo, scale)
