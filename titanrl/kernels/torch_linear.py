"""Batch-invariant `linear` on CPU: `y = x @ W^T (+ b)` whose rows do not depend on the batch.

Contract: for a fixed weight (same values, shape and memory layout), the bits of output row
`r` depend only on input row `r`, never on how many rows the call holds, where `r` sits among
them, or how the leading dimensions are shaped. The same holds for the input gradient of the
backward pass. The weight gradient is correct but sums over rows in whatever order MKL uses.

Why padding works (measured on torch 2.13, MKL 2024.2, AVX2, with 1, 2, 4 and 8 OpenMP threads
over ~200 shapes; tests/test_kernels.py re-checks 1 and 2 threads):
- MKL's float32 GEMM gives a row one of three results depending on the call: M = 1, M in
  {2, 3}, and M >= 4. With several threads MKL splits the rows into chunks, and a chunk of
  1-3 rows falls back into the small-M classes; row counts that are multiples of 4 keep every
  chunk a multiple of 4.
- When the output width N is small or not a multiple of 16, MKL's kernel choice (and, with
  threads, its split of the columns) again depends on M and on the row's position.
So rows are padded to a multiple of 4 (at least 4) and output columns to a multiple of 16.
Padding rows/columns are zeros: they never enter a real row's dot products.
On an AVX-512 CPU these classes do not hold; there MKL is held to its strict AVX2 kernels
(`titanrl.kernels.mkl_mode`), where they do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titanrl.kernels.mkl_mode import ensure_strict_mkl

ROW_MULTIPLE = 4
"""Rows are padded to a multiple of this (and at least this many): MKL's M >= 4 class."""
COL_MULTIPLE = 16
"""Output columns are padded to a multiple of this, so MKL never takes its narrow-N paths."""


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, (n + multiple - 1) // multiple * multiple)


def linear_rows(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """`x_MK @ w_NK^T` for a 2-D input with row-invariant bits; no autograd (used by `linear`).

    `w_NK` may be any strided view (the backward passes `W^T`); its layout is part of the
    contract: the same weight view gives the same bits.
    """
    ensure_strict_mkl()
    M, K = x_MK.shape
    N = w_NK.shape[0]
    x_MK = x_MK.contiguous()
    n_pad = _round_up(N, COL_MULTIPLE)
    if n_pad != N:
        w_NK = torch.cat([w_NK, w_NK.new_zeros(n_pad - N, K)])
    m_pad = _round_up(M, ROW_MULTIPLE)
    if m_pad == M:
        y = F.linear(x_MK, w_NK)
    elif M < ROW_MULTIPLE:
        y = F.linear(F.pad(x_MK, (0, 0, 0, m_pad - M)), w_NK)[:M]
    else:
        # Only the tail needs padding: the first floor(M/4)*4 rows run as they are.
        m_main = M - M % ROW_MULTIPLE
        tail = torch.cat([x_MK[m_main:], x_MK.new_zeros(m_pad - M, K)])
        parts = [F.linear(tail, w_NK)[: M - m_main]]
        if m_main:
            parts.insert(0, F.linear(x_MK[:m_main], w_NK))
        y = torch.cat(parts) if len(parts) > 1 else parts[0]
    # Contiguous output: later elementwise ops take their vectorized path on every element.
    return y[:, :N].contiguous() if n_pad != N else y


class _InvariantLinear(torch.autograd.Function):
    """Autograd for `linear`: row-invariant forward and input gradient, plain weight gradient."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        ctx.has_bias = bias_N is not None
        y = linear_rows(x_MK, w_NK)
        # A separate elementwise add (not addmm) keeps the bias out of MKL's kernel choice.
        return y + bias_N if bias_N is not None else y

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        grad_MN = grad_MN.contiguous()
        if ctx.needs_input_grad[0]:
            grad_x = linear_rows(grad_MN, w_NK.t())  # dL/dx = dL/dy @ W, row by row
        if ctx.needs_input_grad[1]:
            grad_w = grad_MN.t() @ x_MK
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_MN.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with batch-invariant rows, for any leading shape of `x`.

    x: [..., K]; weight: [N, K]; bias: [N] or None. Returns [..., N] in x's dtype.
    """
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x's last dimension ({x.shape[-1]}) must equal weight.shape[1] ({weight.shape[1]})"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, x.shape[-1])
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        y = _InvariantLinear.apply(x_MK, weight, bias)
    else:  # inference: skip the autograd.Function's overhead (same arithmetic)
        y = linear_rows(x_MK, weight)
        y = y + bias if bias is not None else y
    return y.reshape(*lead, weight.shape[0])
