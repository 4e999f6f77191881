"""Batch-invariant ops: each row's bits do not depend on the rest of the batch.

Every op here gives a row (a token, a query) the same output bits whatever else shares the
call: how many rows, where the row sits, how the sequence was padded or chunked, and whether
it is a training forward, a prefill or a decode step. Used for TitanRL's batch-invariant mode,
where the trainer and the generator must compute bitwise-identical log-probabilities.

Two implementations with the same signatures, picked per call by `backend(tensor)`:
- 'torch' (CPU): torch ops arranged so MKL/ATen keep a fixed per-row arithmetic
  (`torch_linear`, `torch_rms_norm`, `swiglu`, `rotary`, `torch_logprobs` modules), and for
  attention a small C++ kernel compiled on first use (`cpu_attention`, `cpu_build`) that can
  also read vLLM's paged KV cache in place;
- 'triton' (CUDA tensors when Triton imports): fixed-tile Triton kernels (`triton_*` modules).
`silu_gate` and `apply_rotary` are elementwise; on CUDA torch's own kernels apply one scalar
formula per element, so they use the torch code on both backends.

Bits are invariant within one backend and one configuration (block sizes), not across them.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from titanrl.kernels import cpu_attention as _attention
from titanrl.kernels import torch_linear as _linear
from titanrl.kernels import torch_logprobs as _logprobs
from titanrl.kernels import torch_rms_norm as _rms_norm
from titanrl.kernels.rotary import apply_rotary
from titanrl.kernels.swiglu import silu_gate

__all__ = [
    "apply_rotary",
    "attention",
    "backend",
    "linear",
    "log_softmax",
    "rms_norm",
    "silu_gate",
    "token_logprobs",
]


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend(x: torch.Tensor) -> str:
    """'triton' for a CUDA tensor when Triton is installed, else 'torch'."""
    return "triton" if x.is_cuda and _triton_available() else "torch"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant `F.linear`: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    if backend(x) == "triton":
        from titanrl.kernels import triton_matmul

        return triton_matmul.linear(x, weight, bias)
    return _linear.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant Qwen3 RMSNorm over x's last dimension."""
    if backend(x) == "triton":
        from titanrl.kernels import triton_rms_norm

        return triton_rms_norm.rms_norm(x, weight, eps)
    return _rms_norm.rms_norm(x, weight, eps)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Batch-invariant log softmax(logits / temperature) over the last dimension (float32)."""
    if backend(logits) == "triton":
        from titanrl.kernels import triton_log_softmax

        return triton_log_softmax.log_softmax(logits, temperature)
    return _logprobs.log_softmax(logits, temperature)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Batch-invariant `titanrl.trainer.grpo.token_logprobs`: [..., V], [...] -> [...]."""
    if backend(logits) == "triton":
        from titanrl.kernels import triton_log_softmax

        return triton_log_softmax.token_logprobs(logits, targets, temperature)
    return _logprobs.token_logprobs(logits, targets, temperature)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: torch.Tensor | int | None = None,
    kv_lens: torch.Tensor | int | None = None,
    scale: float | None = None,
    heads_first: bool = False,
) -> torch.Tensor:
    """Batch-invariant causal GQA attention; arguments as `titanrl.kernels.cpu_attention.attention`."""
    kw = dict(q_start=q_start, kv_lens=kv_lens, scale=scale, heads_first=heads_first)
    if backend(q) == "triton":
        from titanrl.kernels import triton_attention

        return triton_attention.attention(q, k, v, **kw)
    return _attention.attention(q, k, v, **kw)
