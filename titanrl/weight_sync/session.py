"""The driver's view: one trainer actor, N worker actors, one transport, as three calls.

    sync = WeightSync.open(trainer, workers, config.rollout.weight_transport)
    push = sync.push(version)          # after each optimizer step
    seconds = push.wait()              # or keep push.refs and wait later
    sync.close()                       # on shutdown

The actors are Ray actor handles of `GRPOTrainer` / `TrainerGroup` and `RolloutWorker`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from titanrl.weight_sync.plan import WeightSyncPlan, make_plan


@dataclass
class WeightPush:
    """One version on its way; every ref must be awaited before the next push's results matter."""

    loads: list[Any]
    """Per worker, an ObjectRef of `receive_weights`' result: seconds that worker spent loading."""
    sent: Any
    """ObjectRef of the trainer's `send_weights` seconds (broadcast's / shared memory's transfer)."""
    started: float
    """time.perf_counter() when the push was submitted."""

    @property
    def refs(self) -> list[Any]:
        """Everything to wait on (errors of either side surface through these)."""
        return [*self.loads, self.sent]

    def wait(self) -> float:
        """Blocks until every worker has loaded; returns the wall time since `push` (time/weight_sync_s)."""
        import ray

        ray.get(self.refs)
        return time.perf_counter() - self.started


class WeightSync:
    """Opens a transport between a trainer actor and worker actors, pushes versions, closes it."""

    def __init__(self, trainer: Any, workers: list[Any], plan: WeightSyncPlan) -> None:
        """Opens `plan` on the trainer and every worker concurrently (broadcast needs them all at once)."""
        import ray

        if len(workers) != plan.num_receivers:
            raise ValueError(f"the plan expects {plan.num_receivers} workers, got {len(workers)}")
        self.trainer, self.workers, self.plan = trainer, list(workers), plan
        if plan.transport == "broadcast":
            # A group's members wait in open_weight_sync for every member, up to the plan's timeout
            # (300 s): a worker that died before it was up (a replacement placed on its lost node before
            # Ray marked the node dead) fails the opening here (RayActorError), before anyone waits for it.
            ray.get([w.__ray_ready__.remote() for w in self.workers])
        ray.get([trainer.open_weight_sync.remote(plan)]
                + [w.open_weight_sync.remote(plan, rank) for rank, w in enumerate(self.workers, start=1)])

    @classmethod
    def open(cls, trainer: Any, workers: list[Any], transport: str, **options: Any) -> WeightSync:
        """`transport` is RolloutConfig.weight_transport; `options` are WeightSyncPlan fields."""
        return cls(trainer, workers, make_plan(transport, len(workers), **options))

    def add_receiver(self, worker: Any) -> None:
        """'object_store' only (no group to re-form): `worker` joins as the next rank and gets every
        later push; the others open again with the members they should have."""
        import dataclasses

        if self.plan.transport != "object_store":
            raise ValueError(f"{self.plan.transport!r} fixes its members when it opens: open it again with the new one")
        self.workers.append(worker)
        self.plan = dataclasses.replace(self.plan, num_receivers=len(self.workers))
        worker.open_weight_sync.remote(self.plan, len(self.workers))

    def remove_receiver(self, index: int) -> None:
        """'object_store' only: the receiver at `index` (0-based) gets no more pushes."""
        import dataclasses

        if self.plan.transport != "object_store":
            raise ValueError(f"{self.plan.transport!r} fixes its members when it opens: open it again without it")
        del self.workers[index]
        self.plan = dataclasses.replace(self.plan, num_receivers=len(self.workers))

    def push(self, version: int) -> WeightPush:
        """Publishes the trainer's current weights as `version` to every worker (non-blocking).

        Each worker loads after the calls already queued on it (Ray runs an actor's calls in
        order). With 'broadcast' the trainer's send waits for every worker to reach its load.
        """
        started = time.perf_counter()
        announcement = self.trainer.publish_weights.remote(version)
        loads = [w.receive_weights.remote(announcement, version) for w in self.workers]
        sent = self.trainer.send_weights.remote(version)
        return WeightPush(loads, sent, started)

    def close(self) -> None:
        """Closes both ends (unlinks shared memory, leaves the group); tolerates dead actors."""
        import ray

        refs = []
        for actor in [*self.workers, self.trainer]:
            try:
                refs.append(actor.close_weight_sync.remote())
            except Exception:  # an actor that is gone has nothing left to close
                pass
        for ref in refs:
            try:
                ray.get(ref)
            except Exception:
                pass
