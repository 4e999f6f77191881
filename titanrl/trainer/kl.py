"""KL to the frozen reference policy: Schulman's estimators, the loss term and the reward penalty.

Every estimate is of KL(pi || pi_ref) from tokens sampled from pi, per token, with
log r = log pi_ref(token) - log pi(token) (http://joschu.net/blog/kl-approx.html):

    k1 = -log r              unbiased, can be negative
    k2 = (log r)^2 / 2       biased, >= 0
    k3 = (r - 1) - log r     unbiased, >= 0

`train.kl.in_reward=False` adds kl_coef x the token-mean estimate, with the trainer's logprobs
and their gradient, to the loss (`kl_loss_sum`); True subtracts kl_coef x each completion's summed
estimate, with the generator's logprobs, from its reward before the advantages
(`kl_reward_penalty`), as PPO-RLHF does.
"""

from __future__ import annotations

import torch

from titanrl.config.schema import TrainConfig
from titanrl.trainer.batch import PackedBatch


def token_kl(logprobs_BT: torch.Tensor, reference_BT: torch.Tensor, mask_BT: torch.Tensor,
             estimator: str) -> torch.Tensor:
    """The estimator's per-token KL(pi || pi_ref), 0 where `mask_BT` is 0 (log r is masked before
    exp: a padded position's logprobs must not make an inf, whose product with 0 is NaN)."""
    log_r = (reference_BT - logprobs_BT) * mask_BT
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown train.kl.estimator {estimator!r}: use 'k1', 'k2' or 'k3'")


def kl_in_loss(cfg: TrainConfig) -> bool:
    """Whether the loss carries the KL term (a reference is held and the KL is not in the reward)."""
    return cfg.kl.coef > 0 and not cfg.kl.in_reward


def kl_loss_sum(logprobs_BT: torch.Tensor, sub: PackedBatch, cfg: TrainConfig) -> torch.Tensor | float:
    """kl_coef x the summed token KL of one micro-batch, with its gradient through `logprobs_BT`;
    added to the loss sum, which the step divides by the batch's tokens (a token-mean). 0.0 when
    the loss has no KL term."""
    if not kl_in_loss(cfg):
        return 0.0
    if sub.reference_BT is None:
        raise RuntimeError("train.kl.coef > 0 but the batch has no reference logprobs (PackedBatch.reference_BT)")
    return cfg.kl.coef * token_kl(logprobs_BT, sub.reference_BT, sub.loss_mask_BT, cfg.kl.estimator).sum()


def sequence_kl(batch: PackedBatch, estimator: str) -> torch.Tensor:
    """[B] each completion's summed token KL, pi's logprobs being the generator's (who sampled it)."""
    if batch.reference_BT is None:
        raise ValueError("the batch has no reference logprobs (PackedBatch.reference_BT)")
    return token_kl(batch.old_logprobs_BT, batch.reference_BT, batch.loss_mask_BT, estimator).sum(1)


def kl_reward_penalty(batch: PackedBatch, cfg: TrainConfig) -> torch.Tensor:
    """[B] what train.kl.in_reward subtracts from each sample's reward: kl_coef x its sequence KL."""
    return cfg.kl.coef * sequence_kl(batch, cfg.kl.estimator)


def kl_metrics(batch: PackedBatch, cfg: TrainConfig) -> dict[str, float]:
    """kl/mean and kl/max: token-mean and max over the batch's trained tokens of the estimate, from
    the generator's logprobs (the policy that sampled them: the weights before this step's update,
    up to staleness), in either mode; with train.kl.in_reward, kl/reward_penalty: the mean over
    samples of what their rewards lost."""
    mask = batch.loss_mask_BT
    kl = token_kl(batch.old_logprobs_BT, batch.reference_BT, mask, cfg.kl.estimator)
    trained = mask > 0
    out = {
        "kl/mean": (kl.sum() / mask.sum().clamp(min=1.0)).item(),
        "kl/max": kl[trained].max().item() if trained.any() else 0.0,
    }
    if cfg.kl.in_reward:
        out["kl/reward_penalty"] = (cfg.kl.coef * kl.sum(1)).mean().item()
    return out
