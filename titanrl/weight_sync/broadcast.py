"""Broadcast transport: a torch.distributed group of its own, trainer rank 0 to workers 1..N.

The group is a standalone process-group object built on its own TCPStore, not
`init_process_group`: an in-process vLLM engine has already set up the default group in the
worker's process, and a parallel trainer's ranks have their own world; neither is touched.
gloo sends CPU buckets over TCP; NCCL (untested here: this machine has no GPU) sends CUDA buckets.

Every push streams the flat layout (`titanrl.weight_sync.layout`) in buckets of `bucket_bytes`
through two reusable bucket buffers per side, so no side ever holds a second copy of the model:
the sender packs bucket k+1 while bucket k is in flight, a receiver writes bucket k into the
parameters while bucket k+1 arrives. Before the first bucket, one all-reduce lets any receiver
refuse the push (wrong model, wrong version) so that every side fails with an error instead
of waiting on a peer that will never come.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.layout import WeightSyncError, bucket_pieces, torch_dtype
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
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast(self, buffer: torch.Tensor) -> dist.Work:
        """Starts broadcasting `buffer` from rank 0 (asynchronous: wait on the returned work)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.pg.broadcast([buffer], opts)

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # a peer that is already gone: nothing left to shut down cleanly
            pass
        self._buffers = []


def _bucket_len(k: int, total: int, bucket_bytes: int) -> int:
    return min(bucket_bytes, total - k * bucket_bytes)


class BroadcastSender:
    """Trainer side (rank 0)."""

    phase = "send"
    """The call in which this transport reads the source (a parallel trainer's other ranks join its gathers then)."""

    def __init__(self, plan: WeightSyncPlan) -> None:
        self.group = BroadcastGroup(plan, 0)
        self.bucket_bytes = plan.bucket_bytes
        self._published: tuple[int, object] | None = None

    def publish(self, version: int, source: WeightSource) -> WeightAnnouncement:
        """Only announces (layout, bucket size): the bytes move in `send`, once the workers listen."""
        layout = source.layout()
        self._published = (version, layout)
        return WeightAnnouncement("broadcast", version, layout, bucket_bytes=self.bucket_bytes)

    def send(self, version: int, source: WeightSource) -> float:
        """Streams `version` to every worker; returns once the last bucket is handed to the group."""
        t0 = time.perf_counter()
        if self._published is None or self._published[0] != version:
            raise WeightSyncError(f"send_weights({version}) must follow publish_weights({version})")
        layout = self._published[1]
        self._published = None
        if self.group.max_over_members(0):
            raise WeightSyncError(f"a rollout worker refused weight version {version} (its own error says why); "
                                  "nothing was sent")
        B, total = self.bucket_bytes, layout.total_bytes
        per_tensor: list[list[tuple[int, object]]] = [[] for _ in layout.tensors]
        for k, pieces in enumerate(bucket_pieces(layout, B)):
            for p in pieces:
                per_tensor[p.index].append((k, p))
        buffers = self.group.buffers(B)
        works: list[dist.Work | None] = [None, None]
        filling = 0  # the bucket being packed

        def flush(k: int) -> None:
            works[k % 2] = self.group.broadcast(buffers[k % 2][: _bucket_len(k, total, B)])

        for i, tensor in in_layout_order(layout, source):
            spec = layout.tensors[i]
            flat = tensor.detach().reshape(-1)
            for k, p in per_tensor[i]:
                while filling < k:
                    flush(filling)
                    filling += 1
                    if works[filling % 2] is not None:
                        works[filling % 2].wait()  # the buffer's previous bucket has left
                        works[filling % 2] = None
                dst = buffers[k % 2][p.start : p.start + p.count * spec.itemsize].view(torch_dtype(spec.dtype))
                dst.copy_(flat[p.first : p.first + p.count])
        num_buckets = -(-total // B)
        while filling < num_buckets:
            flush(filling)
            filling += 1
            if filling < num_buckets and works[filling % 2] is not None:
                works[filling % 2].wait()
        for work in works:
            if work is not None:
                work.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.group.close()


def receive_broadcast(group: BroadcastGroup, target: ParameterTarget, announcement: WeightAnnouncement,
                      version: int) -> int:
    """Receiver side: takes part in the push of `announcement` and writes it into the parameters;
    returns how many tensors were loaded. A problem found here is first reported to the whole
    group (so the trainer does not wait forever), then raised."""
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
    refused = group.max_over_members(1 if problem else 0)
    if problem is not None:
        raise problem
    if refused:
        raise WeightSyncError(f"another rollout worker refused weight version {version}; nothing was loaded")
    B, total = ann.bucket_bytes, ann.layout.total_bytes
    pieces = bucket_pieces(ann.layout, B)
    buffers = group.buffers(B)
    works: dict[int, dist.Work] = {}

    def post(k: int) -> None:
        if k < len(pieces):
            works[k] = group.broadcast(buffers[k % 2][: _bucket_len(k, total, B)])

    post(0)
    post(1)
    loaded = set()
    for k, bucket in enumerate(pieces):
        works.pop(k).wait()
        buf = buffers[k % 2]
        for p in bucket:
            spec, dest = ann.layout.tensors[p.index], dests[p.index]
            if dest is not None:
                src = buf[p.start : p.start + p.count * spec.itemsize].view(torch_dtype(spec.dtype))
                write_piece(dest, p.first, src)
                loaded.add(p.index)
        post(k + 2)
    return len(loaded)
