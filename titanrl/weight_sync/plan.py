"""What the driver decides once, before the first push: transport, receivers, and (broadcast) where to meet.

The same plan goes to the trainer (`open_weight_sync(plan)`) and to every worker
(`open_weight_sync(plan, rank)`, ranks 1..num_receivers; the trainer is rank 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TRANSPORTS = ("object_store", "shared_memory", "broadcast")
"""The values of `RolloutConfig.weight_transport`."""
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class WeightSyncPlan:
    """How weights travel from the trainer to the rollout workers."""

    transport: str
    """'object_store' (Ray's object store), 'shared_memory' (segments every worker on the trainer's
    machine maps) or 'broadcast' (a torch.distributed group: trainer rank 0, workers 1..N)."""
    num_receivers: int
    """Rollout workers that load every push; a push is done when all of them confirmed."""
    host: str = "127.0.0.1"
    """broadcast: address of the trainer's TCPStore (rank 0 listens there); this machine by default."""
    port: int = 0
    """broadcast: the TCPStore's port (`make_plan` picks a free one)."""
    backend: str = "gloo"
    """broadcast: 'gloo' (CPU bucket buffers, works with any devices) or 'nccl' (CUDA buffers;
    trainer rank 0 and every engine on a GPU; not tested on this CPU-only machine)."""
    bucket_bytes: int = 32 << 20
    """broadcast: bytes per bucket; each side holds two bucket buffers, never a second model copy."""
    direct_bytes: int = 1 << 20
    """broadcast: a tensor of at least this many bytes goes in a broadcast of its own, straight from
    the trainer's tensor into the engine's parameter; smaller ones are packed into buckets."""
    zero_copy: bool = True
    """shared_memory: each receiver's Parameters become views of the segment the trainer wrote
    (where dtype and shape match), so a push costs the trainer's one copy and no receiver copy;
    the segment then stays reserved until the next version replaces the views. False: every
    receiver copies the segment into its own Parameters."""
    timeout_s: float = 300.0
    """Longest wait for a peer: group set-up, a push's first exchange (broadcast: every worker
    reaches its load after the generation queued before it), or a free shared-memory segment."""
    stream_timeout_s: float = 60.0
    """broadcast: longest one bucket or direct tensor may take once every member has joined the
    push. A member lost mid-push is not always noticed by gloo (its peers would wait `timeout_s`):
    past this the push fails on every member, and the run replaces the lost one."""
    group_name: str = "titanrl_weight_sync"
    """broadcast: key prefix in the store, so other users of the same store cannot collide."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight transport must be one of {', '.join(map(repr, TRANSPORTS))} "
                             f"(rollout.weight_transport), got {self.transport!r}")
        if self.num_receivers < 1:
            raise ValueError(f"WeightSyncPlan.num_receivers must be >= 1, got {self.num_receivers}")
        if self.backend not in BACKENDS:
            raise ValueError(f"WeightSyncPlan.backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.transport == "broadcast" and not 0 < self.port < 65536:
            raise ValueError(f"WeightSyncPlan.port must be a TCP port for broadcast, got {self.port} "
                             "(make_plan picks a free one)")
        from titanrl.weight_sync.layout import ALIGN

        if self.bucket_bytes <= 0 or self.bucket_bytes % ALIGN:
            raise ValueError(f"WeightSyncPlan.bucket_bytes must be a positive multiple of {ALIGN}, "
                             f"got {self.bucket_bytes}")
        if self.direct_bytes <= 0:
            raise ValueError(f"WeightSyncPlan.direct_bytes must be positive, got {self.direct_bytes}")
        for field in ("timeout_s", "stream_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"WeightSyncPlan.{field} must be positive, got {getattr(self, field)}")

    @property
    def world_size(self) -> int:
        """Trainer plus receivers."""
        return self.num_receivers + 1

    def to_wire(self) -> dict:
        """Plain dict (vLLM's multiprocess RPC carries no dataclasses)."""
        return asdict(self)

    @staticmethod
    def from_wire(wire: dict) -> WeightSyncPlan:
        return WeightSyncPlan(**wire)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_plan(transport: str, num_receivers: int, **options) -> WeightSyncPlan:
    """A plan for `transport` (RolloutConfig.weight_transport); broadcast gets a free port on `host`.

    `options` are WeightSyncPlan's other fields. The port is picked on this machine, so the
    trainer must run here (a single-machine run) unless `host` and `port` are given.
    """
    if transport == "broadcast" and not options.get("port"):
        options["port"] = free_port(options.get("host", "127.0.0.1"))
    return WeightSyncPlan(transport=transport, num_receivers=num_receivers, **options)
