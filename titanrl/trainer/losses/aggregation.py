"""Loss aggregation: per-row weights computed once from the whole (mini)batch.

The step sums each micro-batch's weighted per-token losses and divides by the batch's trained
token count N. A mode is a weight per row such that that division gives its average:

    token-mean                 1 (no weight: sum / N)
    seq-mean-token-mean        N / (S * n_i)       -> mean over sequences of each one's token mean
    seq-mean-token-sum-norm    N / (S * L)         -> mean over sequences of each one's token sum / L

with S the sequences holding a trained token, n_i row i's trained tokens and L a constant. The
weights depend only on whole rows and batch totals, so splitting rows over micro-batches and
ranks, or a row's tokens over context-parallel ranks, leaves the loss and gradient unchanged.
"""

from __future__ import annotations

import torch


def row_weights(aggregation: str, row_tokens_B: torch.Tensor, total_tokens: torch.Tensor, sequences: torch.Tensor,
                length_norm: int | None) -> torch.Tensor | None:
    """[B] weights of one micro-batch's rows (None for token-mean).

    row_tokens_B: trained tokens of each whole row; total_tokens, sequences: of the whole batch.
    """
    if aggregation == "token-mean":
        return None
    if aggregation == "seq-mean-token-mean":
        per_row = row_tokens_B
    elif aggregation == "seq-mean-token-sum-norm":
        if length_norm is None:
            raise ValueError("train.loss.length_norm is None: set it (the driver sets rollout.sampling.max_new_tokens)")
        per_row = torch.full_like(row_tokens_B, float(length_norm))
    else:
        raise ValueError(f"unknown train.loss.aggregation {aggregation!r}")
    weights = total_tokens / (sequences.clamp(min=1) * per_row.clamp(min=1))
    return torch.where(row_tokens_B > 0, weights, torch.zeros_like(weights))


def batch_sequences(row_tokens_B: torch.Tensor) -> torch.Tensor:
    """Sequences of a batch that hold at least one trained token (the S above)."""
    return (row_tokens_B > 0).sum().to(row_tokens_B.dtype)
