"""Broadcast transport: a torch.distributed group of its own, trainer rank 0 to workers 1..N.

The group is a standalone process-group object built on its own TCPStore, not
`init_process_group`: an in-process vLLM engine has already set up the default group in the
worker's process, and a parallel trainer's ranks have their own world; neither is touched.
gloo sends CPU buckets over TCP; NCCL (untested here: this machine has no GPU) sends CUDA buckets.

Every push is one sequence of broadcasts that each member derives from the layout alone
(`push_ops`): a tensor of at least `direct_bytes` is broadcast straight from the trainer's tensor
into the engine's parameter (no bucket copies on either side: on loopback TCP each copy costs
about a memory copy of its bytes); the small ones (norms, biases) are packed, in buckets of
`bucket_bytes`, through two reusable bucket buffers per side: the sender packs bucket k+1 while
bucket k is in flight, a receiver unpacks bucket k while k+1 arrives. No side ever holds a second
copy of the model (the sender keeps at most two buckets' worth of direct sends in flight).
Before the first broadcast, one all-reduce lets any receiver refuse the push (wrong model, wrong
version) so that every side fails with an error instead of waiting on a peer that will never come.

A push that fails on one member must fail on all of them soon, or a live member waits on the
failed one for the group's timeout (300 s). gloo does not guarantee that: a member killed
mid-stream often goes unnoticed by its peers, and a member that gives up on a collective leaves
its connections open, so whoever waits on it keeps waiting. So once every member is in the push,
each broadcast has a short timeout of its own (`WeightSyncPlan.stream_timeout_s`), and a member
whose push fails leaves the group at once (`BroadcastGroup.failing_together`): freeing its
process group closes its connections, and every peer waiting on it fails with "connection
closed". The run replaces the dead member and opens a new group (titanrl/driver/sources/workers.py).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.layout import Piece, WeightLayout, WeightSyncError, bucket_pieces, build_layout, torch_dtype
from titanrl.weight_sync.plan import WeightSyncPlan
from titanrl.weight_sync.source import WeightSource, in_layout_order
from titanrl.weight_sync.target import ParameterTarget, write_piece

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class BroadcastGroup:
    """One member (rank) of the trainer-to-workers group, with its two bucket buffers."""

    def __init__(self, plan: WeightSyncPlan, rank: int) -> None:
        """Blocks until all `plan.world_size` members have joined (or `plan.timeout_s` passes)."""
        if plan.transport != "broadcast":
            raise WeightSyncError(f"a broadcast group needs a 'broadcast' plan, got {plan.transport!r}")
        if not 0 <= rank < plan.world_size:
            raise WeightSyncError(f"broadcast rank {rank} is outside 0..{plan.world_size - 1}: the trainer is 0, "
                                  "workers are 1..num_receivers")
        timeout = datetime.timedelta(seconds=plan.timeout_s)
        self.rank, self.size = rank, plan.world_size
        self.stream_timeout = datetime.timedelta(seconds=plan.stream_timeout_s)
        # Rank 0 (the trainer) runs the store's server; the others connect, retrying until it is up.
        self.store = dist.TCPStore(plan.host, plan.port, plan.world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        store = dist.PrefixStore(plan.group_name, self.store)
        if plan.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            # On one machine, keep the traffic on loopback; across machines, gloo's default interface.
            device = (dist.ProcessGroupGloo.create_device(hostname=plan.host) if plan.host in LOOPBACK
                      else dist.ProcessGroupGloo.create_default_device())
            opts._devices = [device]
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, rank, plan.world_size, opts)
            self.device = torch.device("cpu")
        else:  # NCCL: written for GPU machines, NOT tested here (no GPU on this machine class).
            if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
                raise WeightSyncError("weight sync backend 'nccl' needs CUDA and a CUDA build of torch; use 'gloo'")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(store, rank, plan.world_size, opts)
        self._buffers: list[torch.Tensor] = []

    def buffers(self, bucket_bytes: int) -> list[torch.Tensor]:
        """The two bucket buffers, (re)allocated only when the bucket size changes."""
        if not self._buffers or self._buffers[0].numel() != bucket_bytes:
            self._buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._buffers

    def max_over_members(self, value: int) -> int:
        """The push's first exchange: waits (up to the group's `timeout_s`) for every member to
        reach the push, e.g. a worker finishing the generation queued before its load."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._live().allreduce([t], opts).wait()
        return int(t.item())

    def broadcast(self, buffer: torch.Tensor) -> dist.Work:
        """Starts broadcasting `buffer` from rank 0 (asynchronous: wait on the returned work).
        Every member is in the push by now, so the wait is the short `stream_timeout_s`."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = self.stream_timeout
        return self._live().broadcast([buffer], opts)

    @contextlib.contextmanager
    def failing_together(self, version: int) -> Iterator[None]:
        """Any error inside makes this member leave the group at once (see the module docstring).
        The works of the failed push must live in a function called inside, not in the caller's
        own frame: their frames are cleared so that nothing keeps the connections open."""
        try:
            yield
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)
            self._drop()
            gc.collect()
            e.add_note(f"weight version {version}: broadcast rank {self.rank} left its group after this error, so "
                       "the other members fail now too (a member that died or stopped answering, or one bucket or "
                       f"tensor slower than WeightSyncPlan.stream_timeout_s={self.stream_timeout.total_seconds():g})")
            raise

    def _live(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise WeightSyncError("this broadcast group was left after a failed push (a member died or stopped "
                                  "answering): open a new one")
        return self.pg

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception:  # a peer that is already gone: nothing left to shut down cleanly
                pass
        self._drop()

    def _drop(self) -> None:
        self.pg = None  # the last reference: gloo closes the connections as it is freed
        self._buffers = []


@dataclass(frozen=True)
class PushOps:
    """The broadcasts of one push, in the order every member issues them."""

    ops: tuple[tuple[str, int], ...]
    """("direct", i): tensor i of the layout, in place; ("bucket", k): bucket k of the packed small tensors."""
    small: tuple[int, ...]
    """Layout index of each packed tensor (position j in `packed`)."""
    packed: WeightLayout
    """The small tensors' own flat layout, cut into `buckets`."""
    buckets: tuple[tuple[Piece, ...], ...]
    """Per bucket, its pieces (indices into `packed.tensors`)."""
    lengths: tuple[int, ...]
    """Bytes broadcast for each bucket (up to its last piece)."""


def push_ops(layout: WeightLayout, bucket_bytes: int, direct_bytes: int) -> PushOps:
    """Tensors of at least `direct_bytes` go one broadcast each; the others are packed into
    buckets, each broadcast as soon as the tensor that completes it has been packed."""
    small = tuple(i for i, s in enumerate(layout.tensors) if s.nbytes < direct_bytes)
    packed = build_layout((layout.tensors[i].name, layout.tensors[i].shape, layout.tensors[i].dtype) for i in small)
    buckets = tuple(tuple(b) for b in bucket_pieces(packed, bucket_bytes) if b) if small else ()
    lengths = tuple(max(p.start + p.count * packed.tensors[p.index].itemsize for p in b) for b in buckets)
    completes: dict[int, list[int]] = {}
    for k, b in enumerate(buckets):
        completes.setdefault(b[-1].index, []).append(k)
    position = {i: j for j, i in enumerate(small)}
    ops: list[tuple[str, int]] = []
    for i in range(len(layout.tensors)):
        if i in position:
            ops += [("bucket", k) for k in completes.get(position[i], [])]
        else:
            ops.append(("direct", i))
    return PushOps(tuple(ops), small, packed, buckets, lengths)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat uint8 (gloo broadcasts any dtype this way)."""
    return t.view(-1).view(torch.uint8)


class BroadcastSender:
    """Trainer side (rank 0)."""

    phase = "send"
    """The call in which this transport reads the source (a parallel trainer's other ranks join its gathers then)."""

    def __init__(self, plan: WeightSyncPlan) -> None:
        self.group = BroadcastGroup(plan, 0)
        self.bucket_bytes, self.direct_bytes = plan.bucket_bytes, plan.direct_bytes
        self._published: tuple[int, object] | None = None

    def publish(self, version: int, source: WeightSource) -> WeightAnnouncement:
        """Only announces (layout, bucket and direct sizes): the bytes move in `send`, once the workers listen."""
        layout = source.layout()
        self._published = (version, layout)
        return WeightAnnouncement("broadcast", version, layout, bucket_bytes=self.bucket_bytes,
                                  direct_bytes=self.direct_bytes)

    def send(self, version: int, source: WeightSource) -> float:
        """Streams `version` to every worker; returns once the last broadcast has completed."""
        t0 = time.perf_counter()
        if self._published is None or self._published[0] != version:
            raise WeightSyncError(f"send_weights({version}) must follow publish_weights({version})")
        layout = self._published[1]
        self._published = None
        with self.group.failing_together(version):
            refused = self.group.max_over_members(0)
        if refused:  # every member knows: the group stays whole
            raise WeightSyncError(f"a rollout worker refused weight version {version} (its own error says why); "
                                  "nothing was sent")
        with self.group.failing_together(version):
            self._stream(layout, source)
        return time.perf_counter() - t0

    def _stream(self, layout: WeightLayout, source: WeightSource) -> None:
        plan = push_ops(layout, self.bucket_bytes, self.direct_bytes)
        position = {i: j for j, i in enumerate(plan.small)}
        pieces_of: list[list[tuple[int, Piece]]] = [[] for _ in plan.small]
        for k, bucket in enumerate(plan.buckets):
            for p in bucket:
                pieces_of[p.index].append((k, p))
        buffers = self.group.buffers(self.bucket_bytes) if plan.buckets else []
        bucket_works: dict[int, dist.Work] = {}
        direct: deque[tuple[dist.Work, torch.Tensor]] = deque()  # kept alive until sent
        direct_inflight = 0
        for i, tensor in in_layout_order(layout, source):
            spec = layout.tensors[i]
            j = position.get(i)
            if j is None:
                t = tensor.detach().to(self.group.device).contiguous()  # a live parameter: no copy
                direct.append((self.group.broadcast(_as_bytes(t)), t))
                direct_inflight += spec.nbytes
                while direct_inflight > 2 * self.bucket_bytes and len(direct) > 1:
                    work, sent = direct.popleft()  # bound what a gathered (sharded) source keeps alive
                    work.wait()
                    direct_inflight -= sent.numel() * sent.element_size()
                continue
            flat = tensor.detach().reshape(-1)
            for k, p in pieces_of[j]:
                if k - 2 in bucket_works:
                    bucket_works.pop(k - 2).wait()  # the buffer's previous bucket has left
                dst = buffers[k % 2][p.start : p.start + p.count * spec.itemsize].view(torch_dtype(spec.dtype))
                dst.copy_(flat[p.first : p.first + p.count])
                if p is plan.buckets[k][-1]:  # bucket k is full: off it goes, before its buffer is reused
                    bucket_works[k] = self.group.broadcast(buffers[k % 2][: plan.lengths[k]])
        for work in [*bucket_works.values(), *(w for w, _ in direct)]:
            work.wait()

    def close(self) -> None:
        self.group.close()


def receive_broadcast(group: BroadcastGroup, target: ParameterTarget, announcement: WeightAnnouncement,
                      version: int) -> int:
    """Receiver side: takes part in the push of `announcement` and writes it into the parameters
    (large tensors land in them directly); returns how many tensors were loaded. A problem found
    here is first reported to the whole group (so the trainer does not wait forever), then raised."""
    ann = announcement
    problem: WeightSyncError | None = None
    dests: list[torch.Tensor | None] = []
    try:
        if ann.transport != "broadcast":
            raise WeightSyncError(f"a {ann.transport!r} announcement reached the broadcast receiver")
        if ann.version != version:
            raise WeightSyncError(f"the announcement is for version {ann.version}, receive_weights was told {version}")
        dests = target.check(ann.layout)
    except WeightSyncError as e:
        problem = e
    with group.failing_together(version):
        refused = group.max_over_members(1 if problem else 0)
    if problem is not None:  # every member knows (the exchange above): the group stays whole
        raise problem
    if refused:
        raise WeightSyncError(f"another rollout worker refused weight version {version}; nothing was loaded")
    with group.failing_together(version):
        return _receive_stream(group, ann, dests)


def _receive_stream(group: BroadcastGroup, ann: WeightAnnouncement, dests: list[torch.Tensor | None]) -> int:
    plan = push_ops(ann.layout, ann.bucket_bytes, ann.direct_bytes)
    buffers = group.buffers(ann.bucket_bytes) if plan.buckets else []
    bucket_works: dict[int, dist.Work] = {}
    direct_works: list[dist.Work] = []
    staged: list[tuple[int, torch.Tensor]] = []  # direct tensors that cannot land in place

    def unpack(k: int) -> None:
        bucket_works.pop(k).wait()
        for p in plan.buckets[k]:
            i = plan.small[p.index]
            spec, dest = ann.layout.tensors[i], dests[i]
            if dest is not None:
                src = buffers[k % 2][p.start : p.start + p.count * spec.itemsize].view(torch_dtype(spec.dtype))
                write_piece(dest, p.first, src)

    for kind, n in plan.ops:
        if kind == "bucket":
            if n - 2 in bucket_works:
                unpack(n - 2)  # frees the buffer bucket n arrives in
            bucket_works[n] = group.broadcast(buffers[n % 2][: plan.lengths[n]])
            continue
        spec, dest = ann.layout.tensors[n], dests[n]
        dtype = torch_dtype(spec.dtype)
        if dest is not None and dest.dtype == dtype and dest.device == group.device and dest.is_contiguous():
            landing = dest
        else:  # a tied LM head the engine does not hold, or a cast
            landing = torch.empty(spec.shape, dtype=dtype, device=group.device)
            staged.append((n, landing))
        direct_works.append(group.broadcast(_as_bytes(landing)))
    for k in sorted(bucket_works):
        unpack(k)
    for work in direct_works:
        work.wait()
    for n, landing in staged:
        if dests[n] is not None:
            write_piece(dests[n], 0, landing.reshape(-1))
    return sum(d is not None for d in dests)
