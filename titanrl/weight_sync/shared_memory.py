"""Shared-memory transport: the trainer writes a version once into a segment every worker maps.

Cost per push: one copy trainer -> segment. Receivers load zero-copy (`WeightSyncPlan.zero_copy`):
a Parameter whose dtype and shape match takes the segment's view of its bytes as its data, so
the segment stays pinned (its "done" flag unraised) until a later version replaces every such
view; a Parameter that must be cast is copied. Without zero copy each receiver copies segment
-> parameters (straight from the mapped views, no intermediate buffer). The two overlap: `publish` only
reserves a segment and announces it, `send` writes it chunk by chunk and advances the
segment's "written" counter, and receivers copy each chunk as soon as the counter passes it.
That needs stores to become visible to other processes in program order, which x86 guarantees;
elsewhere (`PIPELINED` False) `publish` writes everything before the announcement leaves and
Ray's messaging orders the rest. Segments are reused once every receiver has loaded what they
hold: steady state writes into memory already mapped everywhere (a fresh tmpfs segment costs
~10x a memory copy in page faults).

Memory: the trainer's pages of a segment are dropped after each write (`release_data_pages`):
the data stays in /dev/shm for the workers, and the trainer's resident memory does not grow by a
model per segment. The next write into the segment maps its pages back (minor faults, no zeroing).

Lifetime: a segment's name is removed as soon as every receiver has mapped it (by the last
receiver, or by the sender on its next publish); the memory lives while someone maps it and
goes with the last process. So a crashed driver leaves names behind only for segments a
receiver never mapped; those carry their creator's pid and the next sender removes them
once that process is gone (`reap_stale_segments`). `close()` removes everything.
"""

from __future__ import annotations

import platform
import secrets
import time
import weakref
from collections.abc import Iterator

import torch

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.layout import TensorSpec, WeightLayout, WeightSyncError, torch_dtype
from titanrl.weight_sync.segment import Segment, reap_stale_segments
from titanrl.weight_sync.source import WeightSource, in_layout_order
from titanrl.weight_sync.target import ParameterTarget, write_piece

MAX_SEGMENTS = 4
"""Versions that may be published but not yet loaded by every receiver; a fifth publish waits."""
CHUNK_BYTES = 4 << 20
"""Granularity at which receivers follow the writer (a tensor larger than this is split)."""
PIPELINED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
"""Receivers may follow the writer through the segment's counter: x86 keeps stores (and loads)
in program order as other cores see them; weaker memory models would need fences Python lacks."""


def _close_all(segments: list[Segment]) -> None:
    for seg in segments:
        seg.close()
    segments.clear()


def _chunks(spec: TensorSpec) -> Iterator[tuple[int, int]]:
    """(first element, element count) of the pieces a tensor is written and read in."""
    step = max(1, CHUNK_BYTES // spec.itemsize)
    for first in range(0, spec.numel, step):
        yield first, min(step, spec.numel - first)


class SharedMemorySender:
    """Trainer side: owns the segments."""

    phase = "send" if PIPELINED else "publish"
    """The call in which this transport reads the source (a parallel trainer's other ranks join its gathers then)."""

    def __init__(self, num_receivers: int, timeout_s: float = 300.0) -> None:
        reap_stale_segments()
        self.num_receivers, self.timeout_s = num_receivers, timeout_s
        self.segments: list[Segment] = []
        self.sender_id = secrets.token_hex(8)
        """Names this sender's segments in announcements, so receivers keep them apart from others'."""
        self._published: tuple[int, WeightLayout, Segment] | None = None
        # At interpreter exit (a trainer actor shut down without close) the names still go.
        self._finalizer = weakref.finalize(self, _close_all, self.segments)

    def publish(self, version: int, source: WeightSource) -> WeightAnnouncement:
        """Reserves a free segment for `version` and announces it (and writes it, if not PIPELINED)."""
        t0 = time.perf_counter()
        layout = source.layout()
        seg = self._free_segment(layout.total_bytes)
        seg.begin(version)
        self._published = (version, layout, seg)
        if not PIPELINED:
            self._write(version, source)
        return WeightAnnouncement("shared_memory", version, layout, publish_seconds=time.perf_counter() - t0,
                                  segment=seg.name, sender_id=self.sender_id,
                                  live_segments=tuple(s.name for s in self.segments), timeout_s=self.timeout_s)

    def send(self, version: int, source: WeightSource) -> float:
        """Writes the version just published (PIPELINED; receivers copy behind the writer)."""
        t0 = time.perf_counter()
        if PIPELINED:
            self._write(version, source)
        return time.perf_counter() - t0

    def _write(self, version: int, source: WeightSource) -> None:
        if self._published is None or self._published[0] != version:
            raise WeightSyncError(f"send_weights({version}) must follow publish_weights({version})")
        _, layout, seg = self._published
        self._published = None
        data = seg.data
        for i, tensor in in_layout_order(layout, source):
            spec = layout.tensors[i]
            dst = data[spec.offset : spec.offset + spec.nbytes].view(torch_dtype(spec.dtype))
            flat = tensor.detach().reshape(-1)
            for first, count in _chunks(spec):
                write_piece(dst, first, flat[first : first + count])
                seg.set_written(spec.offset + (first + count) * spec.itemsize)
        seg.set_written(layout.total_bytes)
        # The workers read the version from /dev/shm; the trainer keeps none of it resident (a
        # model-sized push would otherwise count in its memory until the segment is rewritten).
        seg.release_data_pages()

    def _free_segment(self, data_bytes: int) -> Segment:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for seg in list(self.segments):
                if seg.linked and seg.all_mapped():
                    seg.unlink()  # everyone has it mapped: the name is no longer needed
                if seg.data_bytes != data_bytes and seg.is_free():
                    seg.close()  # the model changed size
                    self.segments.remove(seg)
            for seg in self.segments:
                if seg.is_free():
                    return seg
            if len(self.segments) < MAX_SEGMENTS:
                self.segments.append(Segment.create(data_bytes, self.num_receivers))
                return self.segments[-1]
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{MAX_SEGMENTS} published weight versions are still not loaded by all {self.num_receivers} "
                    f"receivers after {self.timeout_s:g} s: every worker must receive_weights every published "
                    "version (or the plan's num_receivers is larger than the number of workers)"
                )
            time.sleep(0.001)

    def close(self) -> None:
        """Unlinks and unmaps every segment; idempotent."""
        self._published = None
        _close_all(self.segments)


class SegmentCache:
    """Receiver side: the segments this process has mapped, per sender, kept while their sender
    uses them (their names disappear once every receiver mapped them: they cannot be mapped again),
    and the ones that zero-copy loads left Parameters viewing."""

    def __init__(self) -> None:
        self.segments: dict[str, dict[str, Segment]] = {}
        """sender_id -> segment name -> mapped segment."""
        self.pinned: dict[str, tuple[str, Segment, int]] = {}
        """Segment name -> (sender_id, segment, this receiver's rank in it) for segments some
        Parameter's data still lies in: their "done" flag waits until none does (then the sender
        may overwrite them)."""

    def get(self, sender_id: str, name: str) -> Segment:
        mine = self.segments.setdefault(sender_id, {})
        if name not in mine:
            mine[name] = Segment.attach(name)
        return mine[name]

    def retain(self, sender_id: str, names: set[str]) -> None:
        """Unmaps the sender's segments not in `names` (ones it has given up); pinned ones stay."""
        mine = self.segments.get(sender_id, {})
        for name in [n for n in mine if n not in names and n not in self.pinned]:
            mine.pop(name).close()
        if not mine:
            self.segments.pop(sender_id, None)

    def pin(self, sender_id: str, seg: Segment, rank: int) -> None:
        """Parameters now view `seg`: it is not done until `release_unviewed` finds none that does."""
        self.pinned[seg.name] = (sender_id, seg, rank)

    def release_unviewed(self, tensors: list[torch.Tensor]) -> None:
        """Raises the "done" flag of every pinned segment none of `tensors` (the model's
        Parameters) lies in any more: the sender may reuse it."""
        for name, (_, seg, rank) in list(self.pinned.items()):
            if not any(seg.holds(t) for t in tensors):
                seg.mark_done(rank)
                del self.pinned[name]

    def make_private(self, params: list[torch.Tensor], senders: set[str] | None = None) -> int:
        """Gives every Parameter that views a pinned segment (of `senders`; None: of any) a copy
        of its own, then releases those segments. Called before anything writes Parameters in
        place (other receivers map the same memory) and before a sender's segments are unmapped.
        Returns how many Parameters were copied."""
        copied = sum(self.unshare(p, senders) for p in params)
        self.release_unviewed(params)
        return copied

    def unshare(self, tensor: torch.Tensor, senders: set[str] | None = None) -> bool:
        """Moves `tensor` into memory of its own (same values) if it views a pinned segment (of
        `senders`; None: of any); returns whether it did. A view must never be written in place."""
        if not any(seg.holds(tensor) for sender, seg, _ in self.pinned.values() if senders is None or sender in senders):
            return False
        with torch.no_grad():
            tensor.data = tensor.data.clone()
        return True

    def close(self, keep: set[str] = frozenset(), params: list[torch.Tensor] | None = None) -> None:
        """Unmaps every segment, except those of the senders in `keep`. `params`: the model's
        Parameters, copied out of the segments going away (required once loads were zero-copy)."""
        leaving = {s for s in self.segments if s not in keep}
        if params is not None:
            self.make_private(params, leaving)
        for name in [n for n, (sender, _, _) in self.pinned.items() if sender in leaving]:
            del self.pinned[name]  # not told done: its sender never rewrites it under a view
        for sender_id in leaving:
            self.retain(sender_id, set())


def _wait_written(seg: Segment, nbytes: int, version: int, deadline: float) -> None:
    """Returns once the writer has written the first `nbytes` of `version` (polling, backing off)."""
    pause = 2e-5
    while seg.written < nbytes:
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"weight version {version} was published but not written within its timeout "
                f"({seg.written} of {nbytes} bytes): the trainer's send_weights({version}) must follow "
                "publish_weights, concurrently with the workers' receive_weights"
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _adoptable(dest: torch.Tensor, spec: TensorSpec) -> bool:
    """The segment's bytes can become `dest`'s data as they are (no cast, same shape, contiguous)."""
    return dest.dtype == torch_dtype(spec.dtype) and tuple(dest.shape) == spec.shape and dest.is_contiguous()


def load_from_segment(target: ParameterTarget, announcement: WeightAnnouncement, rank: int,
                      cache: SegmentCache, allow_partial: bool = False, zero_copy: bool = False) -> tuple[int, int]:
    """Receiver side: loads the announced version from its segment into the parameters, following
    the writer; returns how many tensors were loaded and how many of them are views of the segment.
    `rank` is this receiver's (1..num_receivers).
    `zero_copy`: Parameters whose dtype and shape match take views of the segment as their data
    (the segment is pinned in `cache` until a later version replaces them); others are copied."""
    ann = announcement
    if ann.segment is None:
        raise WeightSyncError("a shared_memory announcement without a segment name")
    dests = target.check(ann.layout, allow_partial)
    cache.retain(ann.sender_id, set(ann.live_segments) | {ann.segment})
    seg = cache.get(ann.sender_id, ann.segment)
    if not 1 <= rank <= seg.num_receivers:
        raise WeightSyncError(f"receiver rank {rank} is outside 1..{seg.num_receivers} of segment {ann.segment!r}: "
                              "give each worker its own rank from 1 to the plan's num_receivers")
    seg.mark_mapped(rank)
    if seg.version != ann.version:
        raise WeightSyncError(f"segment {ann.segment!r} holds version {seg.version}, the announcement says "
                              f"{ann.version}: announcements must reach each worker in publish order")
    if seg.data_bytes < ann.layout.total_bytes:
        raise WeightSyncError(f"segment {ann.segment!r} has {seg.data_bytes} bytes, "
                              f"the layout needs {ann.layout.total_bytes}")
    deadline = time.monotonic() + ann.timeout_s
    data = seg.data
    loaded = 0
    params = target.tensors()
    views: list[tuple[str, torch.Tensor]] = []
    """Segment views to adopt: taken once the whole version is written (one wait: following the
    writer tensor by tensor gains nothing for a view, and each poll wakes this process)."""
    for spec, dest in zip(ann.layout.tensors, dests, strict=True):
        if dest is None:
            continue
        src = data[spec.offset : spec.offset + spec.nbytes].view(torch_dtype(spec.dtype))
        if zero_copy and _adoptable(dest, spec):
            views.append((spec.name, src.view(spec.shape)))
        else:
            tensor = target.tensor(spec.name)
            cache.unshare(tensor)  # it may view the version before, in a segment others map too
            dest = tensor.data
            for first, count in _chunks(spec):
                _wait_written(seg, spec.offset + (first + count) * spec.itemsize, ann.version, deadline)
                write_piece(dest, first, src[first : first + count])
        loaded += 1
    if views:
        _wait_written(seg, ann.layout.total_bytes, ann.version, deadline)
        for name, view in views:
            target.adopt(name, view)
        cache.pin(ann.sender_id, seg, rank)
    else:
        seg.mark_done(rank)
    cache.release_unviewed(params)  # the versions these views replaced may be rewritten now
    if seg.all_mapped():
        seg.unlink()  # the last receiver to map it removes the name (the sender does, if this races)
    return loaded, len(views)
