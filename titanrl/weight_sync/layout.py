"""Where each weight tensor sits in one flat byte buffer: the shared vocabulary of every transport.

The sender and every receiver derive the same layout from the same (name, shape, dtype) list,
so a shared-memory segment or a stream of broadcast buckets needs no per-tensor headers:
tensor i occupies bytes `[offset, offset + nbytes)`, offsets aligned to `ALIGN` bytes so that a
view of any dtype is aligned and bucket boundaries (multiples of `ALIGN`) fall between elements.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

ALIGN = 64
"""Byte alignment of every tensor's offset (a cache line; a multiple of every element size)."""


class WeightSyncError(RuntimeError):
    """A weight transfer that cannot go ahead; the message says what to change."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (plain strings survive every serialiser on the way)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown tensor dtype {name!r} in a weight layout")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layout."""

    name: str
    """HF parameter name (our model's `state_dict()` key)."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    dtype: str
    """torch dtype name without the 'torch.' prefix, e.g. 'float32'."""
    offset: int
    """Byte offset of its first element in the flat buffer (a multiple of ALIGN)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class WeightLayout:
    """Every tensor of one weight push, in transfer order."""

    tensors: tuple[TensorSpec, ...]
    """The tensors, in the order the sender produces them, with increasing offsets."""
    total_bytes: int
    """Size of the flat buffer holding them all (padding included)."""

    def fingerprint(self) -> str:
        """Short hash of names, shapes and dtypes: equal layouts describe the same model."""
        text = ";".join(f"{t.name}:{'x'.join(map(str, t.shape))}:{t.dtype}" for t in self.tensors)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"{len(self.tensors)} tensors, {self.total_bytes / 2**20:.1f} MiB"

    def to_wire(self) -> dict:
        """Plain lists/ints/strings (vLLM's multiprocess RPC carries no dataclasses)."""
        return {"tensors": [[t.name, list(t.shape), t.dtype, t.offset] for t in self.tensors],
                "total_bytes": self.total_bytes}

    @staticmethod
    def from_wire(wire: dict) -> WeightLayout:
        return WeightLayout(tuple(TensorSpec(n, tuple(s), d, o) for n, s, d, o in wire["tensors"]),
                            int(wire["total_bytes"]))


def build_layout(entries: Iterable[tuple[str, Sequence[int], torch.dtype | str]]) -> WeightLayout:
    """The layout of (name, shape, dtype) entries packed in order, each aligned to ALIGN."""
    specs, offset = [], 0
    for name, shape, dtype in entries:
        dname = dtype if isinstance(dtype, str) else dtype_name(dtype)
        spec = TensorSpec(name, tuple(int(d) for d in shape), dname, offset)
        specs.append(spec)
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise WeightSyncError(f"a weight layout names a tensor twice: {twice}")
    return WeightLayout(tuple(specs), offset)


def layout_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightLayout:
    """The layout of named tensors as they are."""
    return build_layout((name, t.shape, t.dtype) for name, t in tensors)


@dataclass(frozen=True)
class Piece:
    """The part of one tensor that lies inside one bucket."""

    index: int
    """Position of the tensor in `WeightLayout.tensors`."""
    first: int
    """Index of its first element in this piece (into the flattened tensor)."""
    count: int
    """Elements in this piece."""
    start: int
    """Byte position of the piece inside the bucket."""


def bucket_pieces(layout: WeightLayout, bucket_bytes: int) -> list[list[Piece]]:
    """For each bucket of `bucket_bytes` of the flat buffer, the tensor pieces it carries.

    Bucket k is bytes `[k * bucket_bytes, (k + 1) * bucket_bytes)`; a tensor larger than a bucket
    spans several. `bucket_bytes` must be a positive multiple of ALIGN, so cuts fall between elements.
    """
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise WeightSyncError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    buckets: list[list[Piece]] = [[] for _ in range(-(-layout.total_bytes // bucket_bytes))]
    for i, spec in enumerate(layout.tensors):
        pos, end, size = spec.offset, spec.offset + spec.nbytes, spec.itemsize
        while pos < end:
            k = pos // bucket_bytes
            stop = min(end, (k + 1) * bucket_bytes)
            buckets[k].append(Piece(i, (pos - spec.offset) // size, (stop - pos) // size, pos - k * bucket_bytes))
            pos = stop
    return buckets
