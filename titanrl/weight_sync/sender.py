"""The trainer's end of a transport, picked by the plan.

Every sender has `publish(version, source) -> WeightAnnouncement`, `send(version, source) ->
seconds` (where broadcast and pipelined shared memory move the bytes) and `close()`. `phase` says which of publish and
send reads the source: in a parallel trainer the ranks other than 0 get a `PassiveSender`
that joins the source's gathers in that same call, and sends nothing.
"""

from __future__ import annotations

from typing import Protocol

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.plan import WeightSyncPlan
from titanrl.weight_sync.source import WeightSource

def phase(transport: str) -> str:
    """The trainer call ('publish' or 'send') in which `transport` reads the weights (and a
    sharded model is gathered)."""
    if transport == "shared_memory":
        from titanrl.weight_sync.shared_memory import SharedMemorySender

        return SharedMemorySender.phase
    return "send" if transport == "broadcast" else "publish"


class WeightSender(Protocol):
    phase: str

    def publish(self, version: int, source: WeightSource) -> WeightAnnouncement | None: ...

    def send(self, version: int, source: WeightSource) -> float: ...

    def close(self) -> None: ...


def make_sender(plan: WeightSyncPlan) -> WeightSender:
    """The trainer-side sender of `plan.transport`; for 'broadcast' this blocks until every
    worker has joined the group (the workers' `open_weight_sync` must run meanwhile)."""
    if plan.transport == "object_store":
        from titanrl.weight_sync.object_store import ObjectStoreSender

        return ObjectStoreSender()
    if plan.transport == "shared_memory":
        from titanrl.weight_sync.shared_memory import SharedMemorySender

        return SharedMemorySender(plan.num_receivers, plan.timeout_s)
    from titanrl.weight_sync.broadcast import BroadcastSender

    return BroadcastSender(plan)


class PassiveSender:
    """A parallel trainer's rank other than 0: iterates the source (joining its collectives) in
    the transport's phase; announces and sends nothing."""

    def __init__(self, plan: WeightSyncPlan) -> None:
        self.phase = phase(plan.transport)

    def publish(self, version: int, source: WeightSource) -> None:
        if self.phase == "publish":
            for _ in source.tensors():
                pass

    def send(self, version: int, source: WeightSource) -> float:
        if self.phase == "send":
            for _ in source.tensors():
                pass
        return 0.0

    def close(self) -> None:
        pass
