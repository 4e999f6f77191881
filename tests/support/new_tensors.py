"""`ShapesMade`: which new tensors a piece of code makes (for claims that a backward allocates no
[vocab, hidden] gradient)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ShapesMade(TorchDispatchMode):
    """Records the shape of every new tensor an op returns while active (not an in-place op's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {a.data_ptr() for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in inputs:
                self.shapes.append(tuple(t.shape))
        return out
