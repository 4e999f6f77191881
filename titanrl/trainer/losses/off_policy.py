"""Off-policy correction by the ratio w = pi_trainer / pi_generator (no gradient).

pi_trainer is the trainer's policy at the weights the batch starts from (the decoupled loss's
proximal policy: `GRPOStep.batch_logprobs`, or the forward itself when it runs at
those weights). The generator's logprobs differ from it by the train/inference mismatch and by
staleness; these weights correct the policy gradient for that, per token or per sequence:

    tis_token       min(w_t, cap)                          truncated importance sampling
    tis_sequence    min(prod_t w_t, cap)
    mis_token       w_t if low <= w_t <= cap else 0        masked importance sampling
    mis_sequence    prod_t w_t if low <= prod <= cap else 0
    mis_geometric   1 if low <= (prod_t w_t)^(1/n) <= cap else 0   (rejection only)

`tis_token` at behaviour_weight_cap is exactly the decoupled loss's weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RowSum = Callable[[torch.Tensor], torch.Tensor]
"""[B, T] -> [B]: the sum over each whole row (over context-parallel ranks too)."""

MEASURES = ("offpolicy_ratio_sum", "offpolicy_weight_sum", "offpolicy_clipped_tokens", "offpolicy_masked_tokens")
"""Sums over trained tokens that `correction_weights` reports."""
EXTREMES = ("offpolicy_ratio_max", "offpolicy_ratio_neg_min")
"""Maxima it reports (the minimum as the maximum of its negation)."""


def truncated_token_weights(proximal_BT: torch.Tensor, behaviour_BT: torch.Tensor, mask_BT: torch.Tensor,
                            cap: float) -> torch.Tensor:
    """min(pi_prox / pi_behaviour, cap) per token (1 where masked); no gradient."""
    with torch.no_grad():
        return torch.exp((proximal_BT - behaviour_BT) * mask_BT).clamp(max=cap)


@torch.no_grad()
def correction_weights(mode: str, proximal_BT: torch.Tensor, behaviour_BT: torch.Tensor, mask_BT: torch.Tensor,
                       cap: float, low: float, row_sum: RowSum, row_tokens_B: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights [B, T] of `mode` and their measurements (see the module docstring)."""
    trained = mask_BT > 0
    log_w = (proximal_BT - behaviour_BT) * mask_BT
    w = torch.exp(log_w)
    clipped = masked = torch.zeros_like(trained)
    if mode == "tis_token":
        weights = truncated_token_weights(proximal_BT, behaviour_BT, mask_BT, cap)
        clipped = trained & (w > cap)
    elif mode in ("tis_sequence", "mis_sequence", "mis_geometric"):
        log_seq = row_sum(log_w)
        if mode == "mis_geometric":
            log_seq = log_seq / row_tokens_B.clamp(min=1)
        seq = torch.exp(log_seq)[:, None].expand_as(w)
        if mode == "tis_sequence":
            weights, clipped = seq.clamp(max=cap), trained & (seq > cap)
        else:
            keep = (seq >= low) & (seq <= cap)
            kept = seq if mode == "mis_sequence" else torch.ones_like(seq)
            weights, masked = torch.where(keep, kept, torch.zeros_like(seq)), trained & ~keep
    elif mode == "mis_token":
        keep = (w >= low) & (w <= cap)
        weights, masked = torch.where(keep, w, torch.zeros_like(w)), trained & ~keep
    else:
        raise ValueError(f"unknown train.off_policy.correction {mode!r}")
    neg_inf = torch.full_like(w, float("-inf"))
    return weights, {
        "offpolicy_ratio_sum": (w * mask_BT).sum(),
        "offpolicy_weight_sum": (weights * mask_BT).sum(),
        "offpolicy_clipped_tokens": clipped.float().sum(),
        "offpolicy_masked_tokens": masked.float().sum(),
        "offpolicy_ratio_max": torch.where(trained, w, neg_inf).max(),
        "offpolicy_ratio_neg_min": torch.where(trained, -w, neg_inf).max(),
    }
