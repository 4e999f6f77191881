"""Tensors as plain bytes at process boundaries: a uint8 NumPy view, a dtype name and a shape.

The trainer may run on another torch version than the driver and the workers (torch_xla's venv,
`train.compute.device='xla'`), so nothing it returns is a pickled torch object. Pickle protocol 5 hands
the NumPy views to Ray as out-of-band buffers, written straight into the object store.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

PlainTensor = tuple[Any, str, tuple[int, ...]]
"""(uint8 NumPy array of the bytes, dtype name without 'torch.', shape)."""


def to_plain(tensor: torch.Tensor) -> PlainTensor:
    """The tensor's bytes as a uint8 NumPy array sharing its memory (a copy only if it must move
    to the CPU or be made contiguous)."""
    t = tensor.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def from_plain(plain: PlainTensor) -> torch.Tensor:
    """A tensor over the array's memory (the object store's, read-only: receivers only copy from it)."""
    array, dtype, shape = plain
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.from_numpy(array)
    return raw.view(getattr(torch, dtype)).view(shape)


class PlainTensors(dict):
    """A dict of named tensors that pickles as plain bytes (`to_plain`), e.g. a full state dict
    returned by a trainer actor."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, ({name: to_plain(t) for name, t in self.items()},)


def _rebuild(plain: dict[str, PlainTensor]) -> PlainTensors:
    return PlainTensors({name: from_plain(p) for name, p in plain.items()})
