"""GRPO: group-normalized advantages and the per-token clipped surrogate loss."""

from __future__ import annotations

import torch

from titanrl.trainer.losses.off_policy import truncated_token_weights


def group_advantages(rewards_G: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """(r - mean) / (std + eps) within one prompt's group; all-equal rewards give zeros.

    A group where every completion scores the same carries no preference signal, so its
    advantages are exactly zero (not 0/eps noise).
    """
    if rewards_G.numel() == 0 or bool((rewards_G == rewards_G.flatten()[0]).all()):
        return torch.zeros_like(rewards_G)  # float mean of equal values can be off by an ulp
    centered = rewards_G - rewards_G.mean()
    if not scale_by_std:
        return centered
    std = rewards_G.std(unbiased=False) if rewards_G.numel() > 1 else rewards_G.new_zeros(())
    return centered / (std + eps)


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), the generator's sampling distribution."""
    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)


def clipped_surrogate_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    token_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed (not averaged) per-token PPO-clip objective, negated for minimization.

    Returns the *sum* over masked tokens so callers can aggregate micro-batches into a
    token-mean over the whole batch by dividing by the batch's total token count.
    `token_weights_BT` (constants) scale each token's term (see `decoupled_surrogate_loss`).
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = (logprobs_BT - old_logprobs_BT) * mask_BT
    ratio = torch.exp(log_ratio)
    adv = advantages_B[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights_BT is not None:
        per_token = per_token * token_weights_BT
    loss_sum = (per_token * mask_BT).sum()
    with torch.no_grad():
        was = (unclipped != clipped) & (mask_BT > 0)
        low = (was & (ratio < 1.0 - clip_eps)).float().sum()
        was_clipped = was.float().sum()
        stats = {
            "clipped_tokens": was_clipped,
            "clip_low_tokens": low,
            "clip_high_tokens": was_clipped - low,
            "abs_logprob_diff_sum": ((logprobs_BT - old_logprobs_BT).abs() * mask_BT).sum(),
            "max_abs_logprob_diff": ((logprobs_BT - old_logprobs_BT).abs() * mask_BT).max(),
        }
    return loss_sum, stats


def decoupled_surrogate_loss(
    logprobs_BT: torch.Tensor,
    proximal_logprobs_BT: torch.Tensor,
    behaviour_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    weight_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled PPO objective for stale samples (as in AReaL), summed like `clipped_surrogate_loss`.

    The trust region is taken around the proximal policy (the trainer's weights before this
    update), not around the behaviour policy that sampled the tokens, which may be several
    versions older; the behaviour policy enters as the importance weight pi_prox / pi_behav,
    truncated at `weight_cap`. For on-policy tokens the weight is 1 and this is plain PPO-clip.
    """
    weights = truncated_token_weights(proximal_logprobs_BT, behaviour_logprobs_BT, mask_BT, weight_cap)
    return clipped_surrogate_loss(logprobs_BT, proximal_logprobs_BT, advantages_B, mask_BT, clip_eps, clip_eps_high,
                                  token_weights_BT=weights)
