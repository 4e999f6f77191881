"""Object-store transport: the announcement carries the tensors; Ray moves it like any result.

The trainer returns the weights from `publish_weights`; Ray serialises them into its object
store once, and each worker's `receive_weights(announcement_ref, ...)` gets its own copy
(deserialised in the worker's process) that the engine then copies into its parameters.
Works across machines; costs the most copies of the three transports.
"""

from __future__ import annotations

import time

from titanrl.memory import release_object_store_pages
from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.source import WeightSource, in_layout_order


RELEASE_PAGES_MIN_BYTES = 256 << 20
"""Pushes at least this large let go of the store's pages afterwards (`send`). Smaller ones keep
them: the release cost more than it saved there (benchmarks/async_speedup.py's tiny model: async
loop 16.4 s -> 32.1 s with a release after every push)."""


class ObjectStoreSender:
    """Trainer side: nothing to set up."""

    phase = "publish"
    """The call in which this transport reads the source (a parallel trainer's other ranks join its gathers then)."""

    def __init__(self, release_pages_min_bytes: int = RELEASE_PAGES_MIN_BYTES) -> None:
        self.release_pages_min_bytes = release_pages_min_bytes
        self._published_bytes = 0

    def publish(self, version: int, source: WeightSource) -> WeightAnnouncement:
        """The announcement holds the tensors as CPU tensors. They may be views of the live
        parameters: Ray serialises a method's result before the actor runs its next call, so the
        copy in the object store is this version's, but a caller in the same process that keeps
        the announcement past the next optimizer step must copy them itself."""
        t0 = time.perf_counter()
        layout = source.layout()
        tensors = {layout.tensors[i].name: t.detach().to("cpu") for i, t in in_layout_order(layout, source)}
        self._published_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return WeightAnnouncement("object_store", version, layout, publish_seconds=time.perf_counter() - t0,
                                  tensors=tensors)

    def send(self, version: int, source: WeightSource) -> float:
        """Nothing to move (the announcement carried everything). By now Ray has written that
        result into its object store from this process, mapping the pages here; they are let go
        (the store keeps the data), so the trainer's next step does not carry them resident;
        for pushes of at least `release_pages_min_bytes`."""
        if self._published_bytes >= self.release_pages_min_bytes:
            release_object_store_pages()
        return 0.0

    def close(self) -> None:
        pass
