"""The small message a publish produces and the driver hands to every worker.

It names the version and the layout, and carries what the transport needs to find the bytes:
the tensors themselves (object store), a shared-memory segment's name (shared memory), or the
bucket size of the broadcast that follows (broadcast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from titanrl.weight_sync.layout import WeightLayout
from titanrl.weight_sync.plain_tensors import from_plain, to_plain


@dataclass
class WeightAnnouncement:
    """One published policy version, as the receivers need to know it."""

    transport: str
    """The transport that carries this version (a receiver opened for another one refuses it)."""
    version: int
    """Policy version of the weights."""
    layout: WeightLayout
    """Names, shapes, dtypes and byte offsets of every tensor (checked against the engine's model)."""
    publish_seconds: float = 0.0
    """Trainer time spent publishing (gather and copy into the transport), for time/weight_sync_s."""
    tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    """object_store: the weights themselves (Ray copies them into its object store)."""
    segment: str | None = None
    """shared_memory: name of the segment holding this version."""
    sender_id: str = ""
    """shared_memory: which sender owns the segments (a receiver may map several senders')."""
    live_segments: tuple[str, ...] = ()
    """shared_memory: every segment the sender still owns; receivers unmap the others."""
    bucket_bytes: int = 0
    """broadcast: bytes per broadcast bucket."""
    direct_bytes: int = 1 << 20
    """broadcast: tensors of at least this many bytes are broadcast one by one, in place."""
    timeout_s: float = 300.0
    """shared_memory: longest a receiver waits for the trainer to write what it announced."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (Ray's object store) with each tensor as a uint8 NumPy view of its bytes: pickle
        protocol 5 hands those to Ray as out-of-band buffers, written straight into the object
        store. A torch tensor would first be pickled into an in-memory copy of every byte (a
        second copy of the model in the trainer, and again in each worker)."""
        state = dict(self.__dict__)
        if self.tensors is not None:
            state["tensors"] = {name: to_plain(t) for name, t in self.tensors.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tensors = state.get("tensors")
        if tensors is not None:
            state = {**state, "tensors": {name: from_plain(plain) for name, plain in tensors.items()}}
        self.__dict__.update(state)

    def to_wire(self) -> dict:
        """Plain data for vLLM's multiprocess RPC (tensors never go this way)."""
        return {"transport": self.transport, "version": self.version, "layout": self.layout.to_wire(),
                "segment": self.segment, "sender_id": self.sender_id, "live_segments": list(self.live_segments),
                "bucket_bytes": self.bucket_bytes, "direct_bytes": self.direct_bytes, "timeout_s": self.timeout_s}

    @staticmethod
    def from_wire(wire: dict) -> WeightAnnouncement:
        return WeightAnnouncement(wire["transport"], int(wire["version"]), WeightLayout.from_wire(wire["layout"]),
                                  segment=wire["segment"], sender_id=wire["sender_id"],
                                  live_segments=tuple(wire["live_segments"]),
                                  bucket_bytes=int(wire["bucket_bytes"]), direct_bytes=int(wire["direct_bytes"]),
                                  timeout_s=float(wire["timeout_s"]))
