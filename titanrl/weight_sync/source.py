"""Where a sender reads the weights from: any object with `layout()` and `tensors()`.

The trainer hands its own source (`titanrl.trainer.parallel.gather.GatheredWeights`, which
gathers a sharded model); `TensorsWeights` wraps a plain dict of tensors.

A source gives the layout up front and then the tensors one at a time, in layout order, so a
sender copies or sends each as it comes and a sharded model never materialises in full.
In a parallel trainer every rank iterates `tensors()` (the gathers are collectives); only
rank 0 gets tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from titanrl.weight_sync.layout import WeightLayout, WeightSyncError, dtype_name, layout_of


class WeightSource(Protocol):
    def layout(self) -> WeightLayout:
        """Every tensor `tensors()` will yield, in that order."""
        ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) in layout order; a tensor may be a view of a live parameter,
        valid until the model next changes."""
        ...


class TensorsWeights:
    """A dict of named tensors (e.g. a state dict) as a source."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = {k: v.detach() for k, v in tensors.items()}

    def layout(self) -> WeightLayout:
        return layout_of(self._tensors.items())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._tensors.items()


def in_layout_order(layout: WeightLayout, source: WeightSource) -> Iterator[tuple[int, torch.Tensor]]:
    """(index into layout.tensors, tensor) for each tensor of `source`, checking that it keeps its
    layout (names, shapes, dtypes): a source that yields something else is a bug on the sending
    side, named here."""
    count = 0
    for i, (name, tensor) in enumerate(source.tensors()):
        spec = layout.tensors[i] if i < len(layout.tensors) else None
        if (spec is None or spec.name != name or tuple(tensor.shape) != spec.shape
                or dtype_name(tensor.dtype) != spec.dtype):
            expected = f"{spec.name} {spec.shape} {spec.dtype}" if spec else "no more tensors"
            raise WeightSyncError(f"weight source yielded {name} {tuple(tensor.shape)} {dtype_name(tensor.dtype)} "
                                  f"at position {i}, its layout says {expected}")
        count += 1
        yield i, tensor
    if count != len(layout.tensors):
        raise WeightSyncError(f"weight source yielded {count} tensors, its layout has {len(layout.tensors)}")
