"""Batch-invariant RMSNorm on CPU: Qwen3's norm, with each row reduced in one fixed order.

Contract: the bits of a row's output depend only on that row (and the weight), never on the
other rows in the tensor, their number, or the row's position. The gradient w.r.t. the input
is row-invariant too; the weight gradient sums over rows (correct, not batch-invariant).

Why torch's own ops suffice here (measured, torch 2.13 CPU, 1/2/4 threads, widths 1 to
151,936, 1 to 1,000 rows, 2-D and [B, T, H, D] layouts; re-checked in tests/test_kernels.py):
a reduction over the contiguous last dimension runs one vectorized loop per row, and rows are
never split across threads, so `x.pow(2).mean(-1)` has a fixed per-row order. `rsqrt`, `*`
and `+` are exact IEEE ops, identical in the vector and scalar loops. The only requirement is
a contiguous input (a strided view would take a different loop), so the input is made
contiguous first. The arithmetic is exactly `titanrl.models.qwen3.RMSNorm.forward`, so this
returns the same bits as the model's own norm.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / sqrt(mean(x^2, -1) + eps))` in float32 (float64 for float64 x), cast back.

    x: [..., D]; weight: [D]. Returns x's shape, in the dtype of `weight * x`.
    """
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dimension, "
            f"got {tuple(weight.shape)}"
        )
    dtype = x.dtype
    # float32 like the model (float64 stays float64, for gradcheck).
    x32 = x.contiguous().to(torch.float64 if dtype == torch.float64 else torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)
