"""Batch-invariant linear on GPU: a persistent Triton matmul with one fixed tile shape.

Contract: for a fixed weight and a fixed tile config, output row r depends only on input row
r. Every output tile is computed by the same code: a [BLOCK_M, BLOCK_N] accumulator summed
over K in BLOCK_K steps from k = 0 upward, with no split-K and no M-dependent config choice
(cuBLAS picks kernels and split-K by M, which is why its rows change with the batch). The
persistent grid (at most one program per SM, looping over tiles) only changes which program
computes a tile, never how. M and the row strides are not specialized (`do_not_specialize`),
so every batch size runs the same compiled code, FMA contractions included. The input
gradient uses the same kernel (rows of dL/dy @ W);
the weight gradient is a plain torch matmul (correct, not batch-invariant).

float32 inputs use IEEE fp32 products (`input_precision="ieee"`, no TF32) so results match
torch's float32 matmul to ~1e-6 relative; bf16/fp16 use tensor cores with fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape of the invariant matmul; bits are invariant only within one config."""

    block_m: int
    """Rows of x per output tile."""
    block_n: int
    """Output columns per tile."""
    block_k: int
    """Reduction step: the K loop adds BLOCK_K-wide partial products in increasing k."""
    num_warps: int = 4
    """Warps per program (GPU only)."""
    num_stages: int = 3
    """Software-pipelining depth (GPU only)."""


def default_config(x: torch.Tensor) -> MatmulConfig:
    """The fixed config for this device and dtype (never a function of M)."""
    if not x.is_cuda:
        return MatmulConfig(16, 16, 16, 1, 1)  # Triton's CPU interpreter: small, fast to emulate
    if x.dtype == torch.float32:
        return MatmulConfig(64, 64, 32, 4, 3)
    return MatmulConfig(128, 128, 64, 8, 3)


# M is the only batch-dependent argument: never specialize on it (one compiled kernel for all M).
@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(M, BLOCK_M) * n_tiles_n
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        offs_m = (tile // n_tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % n_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0,
            )
            b = tl.load(
                w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0,
            )
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
            acc.to(y_ptr.dtype.element_ty),
            mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
        )


_SM_COUNT: dict[int, int] = {}


def _num_programs(x: torch.Tensor, n_tiles: int) -> int:
    if not x.is_cuda:
        return max(1, min(n_tiles, 4))
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _SM_COUNT:
        _SM_COUNT[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return max(1, min(n_tiles, _SM_COUNT[dev]))


def matmul_rows(x_MK: torch.Tensor, w_NK: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """`x_MK @ w_NK^T` with row-invariant bits (no autograd). `w_NK` may be a strided view."""
    M, K = x_MK.shape
    N = w_NK.shape[0]
    cfg = config or default_config(x_MK)
    y = torch.empty((M, N), dtype=x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0:
        return y
    n_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    grid = (_num_programs(x_MK, n_tiles),)
    _linear_kernel[grid](
        x_MK, w_NK, y, M, N, K,
        x_MK.stride(0), x_MK.stride(1), w_NK.stride(0), w_NK.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        IEEE=x_MK.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


class _TritonLinear(torch.autograd.Function):
    """Invariant forward and input gradient through the Triton kernel; torch weight gradient."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        ctx.has_bias = bias_N is not None
        y = matmul_rows(x_MK, w_NK)
        return y + bias_N if bias_N is not None else y

    @staticmethod
    def backward(ctx, grad_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_rows(grad_MN, w_NK.t())
        if ctx.needs_input_grad[1]:
            grad_w = grad_MN.t() @ x_MK
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_MN.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with batch-invariant rows; x: [..., K], weight: [N, K]."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: weight must be [out_features, in_features={x.shape[-1]}], got {tuple(weight.shape)}"
        )
    lead = x.shape[:-1]
    y = _TritonLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*lead, weight.shape[0])
