"""The policy-gradient term of each train.loss.objective, summed over a micro-batch's weighted tokens.

Each returns (loss_sum, stats): loss_sum = sum over trained tokens of token_weight * loss_t
(token_weights: aggregation and off-policy weights, constants; None is 1), which the step
divides by the batch's token count; stats hold the clip counts `measures` turns into metrics.
`anchor_BT` is the ratio's denominator: the generator's logprobs, or the proximal policy's.
"""

from __future__ import annotations

import torch

from titanrl.trainer.grpo import clipped_surrogate_loss
from titanrl.trainer.losses.off_policy import RowSum
from titanrl.trainer.losses.settings import LossSettings


def policy_loss(s: LossSettings, logprobs_BT: torch.Tensor, anchor_BT: torch.Tensor, advantages_B: torch.Tensor,
                mask_BT: torch.Tensor, token_weights_BT: torch.Tensor | None, row_sum: RowSum,
                row_tokens_B: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The term of `s.loss` (grpo, dr_grpo and dapo share the token clip; they differ in settings)."""
    if s.loss in ("grpo", "dr_grpo", "dapo"):
        return clipped_surrogate_loss(logprobs_BT, anchor_BT, advantages_B, mask_BT, s.clip_low, s.clip_high,
                                      token_weights_BT=token_weights_BT)
    if s.loss == "gspo":
        return sequence_clipped_loss(logprobs_BT, anchor_BT, advantages_B, mask_BT, s.clip_low, s.clip_high,
                                     token_weights_BT, row_sum, row_tokens_B)
    if s.loss == "cispo":
        return clipped_weight_loss(logprobs_BT, anchor_BT, advantages_B, mask_BT, s.clip_high, token_weights_BT)
    raise ValueError(f"unknown train.loss.objective {s.loss!r}")


def sequence_clipped_loss(logprobs_BT: torch.Tensor, anchor_BT: torch.Tensor, advantages_B: torch.Tensor,
                          mask_BT: torch.Tensor, clip_low: float, clip_high: float,
                          token_weights_BT: torch.Tensor | None, row_sum: RowSum, row_tokens_B: torch.Tensor
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: s_i = exp(mean over row i's trained tokens of log(pi / pi_anchor)), PPO-clipped per
    sequence; every trained token of the row carries the sequence's loss (so seq-mean-token-mean
    gives GSPO's mean over sequences). `row_sum` spans the whole row under context parallel."""
    n_B = row_tokens_B.clamp(min=1)
    ratio_B = torch.exp(row_sum((logprobs_BT - anchor_BT) * mask_BT) / n_B)
    unclipped = ratio_B * advantages_B
    clipped = torch.clamp(ratio_B, 1.0 - clip_low, 1.0 + clip_high) * advantages_B
    per_token = (-torch.minimum(unclipped, clipped))[:, None].expand_as(mask_BT)
    if token_weights_BT is not None:
        per_token = per_token * token_weights_BT
    loss_sum = (per_token * mask_BT).sum()
    with torch.no_grad():
        was = (unclipped != clipped)[:, None] & (mask_BT > 0)
        low = was & (ratio_B < 1.0 - clip_low)[:, None]
        # Per token 1 / n_i: a row counts once in total even when cp ranks hold parts of it.
        share = mask_BT / n_B[:, None]
        stats = {"clipped_tokens": was.float().sum(), "clip_low_tokens": low.float().sum(),
                 "clip_high_tokens": (was & ~low).float().sum(),
                 "clipped_sequences": (share * was).sum(), "sequences": share.sum()}
    return loss_sum, stats


def clipped_weight_loss(logprobs_BT: torch.Tensor, anchor_BT: torch.Tensor, advantages_B: torch.Tensor,
                        mask_BT: torch.Tensor, clip_high: float, token_weights_BT: torch.Tensor | None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: -sg(min(r, 1 + clip_high)) * A * log pi per token, r = pi / pi_anchor; no token
    loses its gradient (MiniMax-M1 sets no lower bound on the weight)."""
    ratio = torch.exp((logprobs_BT - anchor_BT) * mask_BT)
    weight = ratio.detach().clamp(max=1.0 + clip_high)
    per_token = -(weight * advantages_B[:, None] * logprobs_BT)
    if token_weights_BT is not None:
        per_token = per_token * token_weights_BT
    loss_sum = (per_token * mask_BT).sum()
    with torch.no_grad():
        high = ((ratio > 1.0 + clip_high) & (mask_BT > 0)).float().sum()
    return loss_sum, {"clipped_tokens": high, "clip_low_tokens": torch.zeros_like(high), "clip_high_tokens": high}
