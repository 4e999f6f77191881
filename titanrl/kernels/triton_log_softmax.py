"""Batch-invariant log-softmax and token log-probabilities on GPU (Triton).

Contract: a row's results depend only on that row, the temperature and the block width (a
function of the vocabulary size only). One program per row: pass 1 takes the max over
BLOCK-wide chunks in order, pass 2 sums exp(x - max) lane by lane in order and reduces the
lanes with one fixed tree, so logsumexp has one reduction order; pass 3 writes x - logsumexp
(or, for `token_logprobs`, only the target's entry is read). The backward is the closed form
(softmax - onehot) in torch ops from the saved logsumexp (correct; per-row arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096
"""Widest chunk a program loads at once; longer rows loop over chunks in order."""


@triton.jit
def _lse_kernel(x_ptr, lse_ptr, V, stride_x, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
        m = tl.maximum(m, x)
    row_max = tl.max(m, axis=0)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
        s += tl.exp(x - row_max)
    tl.store(lse_ptr + row, row_max + tl.log(tl.sum(s, axis=0)))


@triton.jit
def _log_softmax_write_kernel(x_ptr, lse_ptr, y_ptr, V, stride_x, stride_y, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lse = tl.load(lse_ptr + row)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=0.0).to(tl.float32) * inv_temp
        tl.store(y_ptr + row * stride_y + offs, x - lse, mask=offs < V)


def _block(V: int) -> int:
    return min(triton.next_power_of_2(max(V, 1)), MAX_BLOCK)


def logsumexp_rows(x_MV: torch.Tensor, temperature: float) -> torch.Tensor:
    """logsumexp(x / temperature) per row, float32, fixed order (no autograd)."""
    M, V = x_MV.shape
    lse = torch.empty(M, dtype=torch.float32, device=x_MV.device)
    if M:
        _lse_kernel[(M,)](x_MV, lse, V, x_MV.stride(0), 1.0 / temperature, BLOCK=_block(V))
    return lse


class _TritonLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MV: torch.Tensor, temperature: float) -> torch.Tensor:
        x_MV = x_MV.contiguous()
        M, V = x_MV.shape
        lse = logsumexp_rows(x_MV, temperature)
        y = torch.empty((M, V), dtype=torch.float32, device=x_MV.device)
        if M:
            # No FMA contraction: x * (1 / T) - lse is rounded twice, exactly as the torch ops of
            # `token_logprobs` below compute it, so token_logprobs == log_softmax(...).gather(...).
            _log_softmax_write_kernel[(M,)](
                x_MV, lse, y, V, x_MV.stride(0), y.stride(0), 1.0 / temperature, BLOCK=_block(V),
                enable_fp_fusion=False,
            )
        ctx.save_for_backward(y)
        ctx.temperature, ctx.dtype = temperature, x_MV.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        grad_x = (grad - torch.exp(y) * grad.sum(-1, keepdim=True)) / ctx.temperature
        return grad_x.to(ctx.dtype), None


class _TritonTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MV: torch.Tensor, targets_M: torch.Tensor, temperature: float) -> torch.Tensor:
        x_MV = x_MV.contiguous()
        lse = logsumexp_rows(x_MV, temperature)
        # Same fp32 arithmetic as the kernel: x * (1 / temperature) - lse.
        picked = x_MV.gather(-1, targets_M[:, None])[:, 0].float() * (1.0 / temperature)
        ctx.save_for_backward(x_MV, targets_M, lse)
        ctx.temperature = temperature
        return picked - lse

    @staticmethod
    def backward(ctx, grad_M: torch.Tensor):
        x_MV, targets_M, lse = ctx.saved_tensors
        inv_t = 1.0 / ctx.temperature
        softmax = torch.exp(x_MV.float() * inv_t - lse[:, None])
        grad_x = -softmax * grad_M[:, None]
        grad_x.scatter_add_(-1, targets_M[:, None], grad_M[:, None])
        return (grad_x * inv_t).to(x_MV.dtype), None, None


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the last dimension, float32: [..., V] -> [..., V]."""
    _check_temperature(temperature)
    y = _TritonLogSoftmax.apply(logits.reshape(-1, logits.shape[-1]), temperature)
    return y.reshape(logits.shape)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature): [..., V], [...] -> [...] float32."""
    _check_temperature(temperature)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"token_logprobs: targets {tuple(targets.shape)} must match logits without the vocabulary "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    y = _TritonTokenLogprobs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), temperature)
    return y.reshape(targets.shape)
