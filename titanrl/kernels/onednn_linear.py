"""oneDNN for the CPU trainer's float32 linear layers (`train.compute.cpu_matmul`), outside batch-invariant mode.

torch's CPU `F.linear` and its backward go to MKL. On non-Intel CPUs MKL keeps to its AVX2
kernels even where the CPU has AVX-512, while oneDNN (in torch as the `mkldnn` ops) uses
AVX-512 there. Measured on a 2-core AMD EPYC with AVX-512 (torch 2.13, fp32, 4,096 rows, the
19M/25M models' projections): oneDNN's forward and input-gradient GEMMs run at 90-100 GFLOP/s a
core against MKL's 40-85; for the weight gradient MKL was as fast or faster, so it stays there.

`onednn_matmul_nt` is a torch custom op (with its fake tensor rule and autograd formula), so it
runs inside `train.compute.compile`'s compiled blocks as one opaque call, like MKL's GEMM does.
`OneDnnLinear` is nn.Linear with that forward; `apply_onednn_linears` swaps the class of a
model's plain nn.Linear modules in place (names, Parameters and checkpoints unchanged). The
bits differ from MKL's in the last place (another summation order), so this is no mode for
batch invariance, which keeps `titanrl.kernels`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from titanrl.kernels.cpu_build import cpu_vendor, has_avx512


@functools.cache
def onednn_available() -> bool:
    """True where torch was built with oneDNN and has its fused linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_is_faster_here() -> bool:
    """Where `train.compute.cpu_matmul='auto'` picks oneDNN: AMD CPUs with AVX-512 (measured, see the
    module docstring). Elsewhere (AVX2 CPUs, Intel, ARM) MKL stays: not measured to lose there."""
    return onednn_available() and cpu_vendor() == "AuthenticAMD" and has_avx512()


@torch.library.custom_op("titanrl::onednn_matmul_nt", mutates_args=())
def onednn_matmul_nt(a_MK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [N, K].T -> [M, N] through oneDNN (b may be a transposed view)."""
    if a_MK.shape[0] == 0:
        return a_MK.new_zeros(0, b_NK.shape[0])
    return torch.ops.mkldnn._linear_pointwise(a_MK, b_NK, None, "none", [], "")


@onednn_matmul_nt.register_fake
def _(a_MK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    return a_MK.new_empty(a_MK.shape[0], b_NK.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_MN: torch.Tensor):
    a_MK, b_NK = ctx.saved_tensors
    grad_a = onednn_matmul_nt(grad_MN, b_NK.t()) if ctx.needs_input_grad[0] else None
    grad_b = grad_MN.t() @ a_MK if ctx.needs_input_grad[1] else None  # MKL: as fast or faster here
    return grad_a, grad_b


onednn_matmul_nt.register_autograd(_backward, setup_context=_setup_context)


class OneDnnLinear(nn.Linear):
    """nn.Linear whose matmul runs through oneDNN (forward and input gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = onednn_matmul_nt(x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def apply_onednn_linears(model: nn.Module) -> int:
    """Makes every plain nn.Linear of `model` a OneDnnLinear in place; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
            count += 1
    return count
