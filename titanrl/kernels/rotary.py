"""Rotary position embedding, as `titanrl.models.qwen3.apply_rotary` computes it.

Contract: elementwise, so each element's bits depend only on its own inputs. It uses only
negation, concatenation, `*` and `+`, which are exact IEEE operations (no fused multiply-add
across ops, identical in torch's vector and scalar loops), so it is batch-invariant as it
stands and returns the same bits as the model's own function.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, with one cos/sin row per token shared by all heads.

    x: [..., H, D] (e.g. [B, T, H, D] in training, [N, H, D] in vLLM's flat layout);
    cos, sin: [..., D], x's shape without the head dimension (qwen3's `RotaryEmbedding` output).
    """
    if cos.shape != sin.shape or cos.shape != x.shape[:-2] + x.shape[-1:]:
        raise ValueError(
            f"apply_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be x's shape "
            f"without the head dimension, {tuple(x.shape[:-2] + x.shape[-1:])}"
        )
    if x.shape[-1] % 2:
        raise ValueError(f"apply_rotary: head_dim (x's last dimension) must be even, got {x.shape[-1]}")
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin
