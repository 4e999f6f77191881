"""Learning-rate multipliers: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    if decay == "cosine":
        span = max(total_steps - warmup_steps, 1)
        progress = min(max(step - warmup_steps, 0) / span, 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay {decay!r}: use 'constant' or 'cosine'")
