"""The rollout worker's end of a weight transport (`titanrl.weight_sync`): loads announced versions
into its VllmEngine.

The bytes land where the model lives: for shared memory and broadcast the engine's worker
extension maps the segment or joins the group itself (in the engine-core process when vLLM
runs multiprocess), so the multiprocess engine receives tensors, never a serialised file.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.layout import WeightSyncError
from titanrl.weight_sync.plan import WeightSyncPlan

if TYPE_CHECKING:
    from titanrl.rollout.vllm.engine import VllmEngine


class WeightReceiver:
    """One worker's receiving side of a `WeightSyncPlan`."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.plan: WeightSyncPlan | None = None
        self.rank = 0
        """This worker's rank in the plan (1..num_receivers); 0 before `open`."""

    def open(self, plan: WeightSyncPlan, rank: int) -> None:
        """Joins `plan` as receiver `rank` (1..num_receivers). For 'broadcast' this blocks until
        the trainer and every other worker have joined (call them all concurrently)."""
        if not 1 <= rank <= plan.num_receivers:
            raise ValueError(f"receiver rank must be in 1..{plan.num_receivers} (the plan's num_receivers), got {rank}")
        self.close()
        if plan.transport == "broadcast":
            self.engine.open_weight_group(plan, rank)
        self.plan, self.rank = plan, rank

    def receive(self, announcement: WeightAnnouncement, version: int, recompute_running: bool = False) -> float:
        """Loads the announced weights as `version`; returns the seconds it took (for broadcast and
        shared memory, including the wait for the trainer's send). `recompute_running`: see
        VllmEngine.update_weights (a push between engine steps with requests unfinished)."""
        t0 = time.perf_counter()
        ann = announcement
        if not isinstance(ann, WeightAnnouncement):
            raise TypeError(f"receive_weights needs the WeightAnnouncement that publish_weights returned, "
                            f"got {type(ann).__name__}")
        if self.plan is not None and ann.transport != self.plan.transport:
            raise WeightSyncError(f"a {ann.transport!r} announcement reached a worker opened for "
                                  f"{self.plan.transport!r}")
        if ann.transport == "broadcast":
            if self.plan is None:
                raise WeightSyncError("broadcast needs open_weight_sync(plan, rank) on every worker first")
            self.engine.receive_broadcast(ann, version, recompute_running)  # checks inside the group
        else:
            if ann.version != version:
                raise WeightSyncError(f"the announcement is for version {ann.version}, "
                                      f"receive_weights was told {version}")
            if ann.transport == "object_store":
                if ann.tensors is None:
                    raise WeightSyncError("an object_store announcement without tensors")
                self.engine.update_weights(ann.tensors, version, recompute_running=recompute_running)
            else:
                if self.plan is None:
                    raise WeightSyncError("shared_memory needs open_weight_sync(plan, rank) on every worker first")
                self.engine.load_shared_memory(ann, version, self.rank, recompute_running, self.plan.zero_copy)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Leaves the group / unmaps the segments of the plan; idempotent."""
        if self.plan is not None:
            self.plan = None
            self.engine.close_weight_sync()
