"""Batch-invariant RMSNorm on GPU (Triton): one program per row, one fixed reduction order.

Contract: a row's output bits depend only on that row, the weight, eps and the block width
(a function of the row length only). Each program reads its row in BLOCK-wide chunks from
d = 0 upward, accumulates x^2 lane by lane in float32, then reduces the BLOCK lanes with one
fixed tree (`tl.sum`); nothing is shared between rows, and no config depends on the number of
rows. The backward recomputes the norm with torch ops and differentiates that (correct
gradients; the input gradient is per-row arithmetic, the weight gradient sums over rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096
"""Widest chunk a program loads at once; longer rows loop over chunks in order."""


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=offs < D, other=0.0)
        # As the model: normalize in fp32, cast to x's dtype, then scale by the weight.
        y = w * (x * rstd).to(x_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=offs < D)


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_rows(x_MD: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton forward on a 2-D input (no autograd)."""
    M, D = x_MD.shape
    x_MD = x_MD.contiguous()
    y = torch.empty((M, D), dtype=torch.promote_types(x_MD.dtype, weight.dtype), device=x_MD.device)
    if M == 0:
        return y
    block = min(triton.next_power_of_2(D), MAX_BLOCK)
    _rms_norm_kernel[(M,)](x_MD, weight, y, D, x_MD.stride(0), y.stride(0), eps, BLOCK=block)
    return y


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x_MD, weight)
        ctx.eps = eps
        return rms_norm_rows(x_MD, weight, eps)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_MD, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x_MD.detach().requires_grad_(ctx.needs_input_grad[0])
            w_ = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            y = _reference(x_, w_, ctx.eps)
            inputs = [t for t in (x_, w_) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, inputs, grad) if inputs else ())
        grad_x = next(grads) if ctx.needs_input_grad[0] else None
        grad_w = next(grads) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm over the last dimension of x: [..., D]; weight: [D]."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    y = _TritonRMSNorm.apply(x.reshape(-1, x.shape[-1]), weight, eps)
    return y.reshape(x.shape)
