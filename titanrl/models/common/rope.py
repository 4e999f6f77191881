"""Rotary-embedding frequencies: unscaled, or scaled as config.json's `rope_scaling` says.

One function computes the inverse frequencies every family's `RotaryEmbedding` (trainer, vLLM, the
batch-invariant table) uses, so a scaled model rotates identically everywhere. Supported scalings are
the ones a position-independent frequency change expresses: 'linear' and Llama 3.1's 'llama3'.
Any other type is refused by name when the config is read (`read_rope_scaling`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
"""`rope_type` values this module computes."""

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The fields a 'llama3' scaling must give."""


def read_rope_scaling(hf: dict[str, Any], default_theta: float | None) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, scaling) from a config.json dict: transformers >= 5 nests both under
    `rope_parameters`, older files use top-level `rope_theta` and `rope_scaling` (whose type key
    may be spelled `type`). Scaling is None when unscaled; an unsupported type raises ValueError."""
    legacy, current = hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}
    types = {key: d.get("rope_type", d.get("type", "default")) for key, d in
             (("rope_scaling", legacy), ("rope_parameters", current)) if d}
    if len(set(types.values())) > 1:  # neither may be silently dropped
        raise ValueError(f"config.json's rotary settings disagree: {types}; keep one")
    params: dict[str, Any] = {**legacy, **current}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = next(iter(types.values()), "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json sets rotary scaling (rope type) {rope_type!r}, which TitanRL does not "
                         f"implement (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    required = ("factor",) if rope_type == "linear" else LLAMA3_KEYS
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"config.json's {rope_type!r} rope scaling lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **{k: params[k] for k in required}}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths slowed by `factor`, short ones kept, a linear blend between."""
    factor, low, high, original = (s[k] for k in LLAMA3_KEYS)
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, slowed)
