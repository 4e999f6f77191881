"""Weight transports from the trainer to the rollout workers, behind one interface.

Chosen by `RolloutConfig.weight_transport`:
  object_store   the announcement carries the tensors through Ray's object store (any machines)
  shared_memory  the trainer writes each version once into a segment every worker maps (one machine)
  broadcast      a torch.distributed group, trainer rank 0 -> workers 1..N, bucketed (gloo / NCCL)

Actor methods (trainer: GRPOTrainer, TrainerGroup; worker: RolloutWorker):
  set-up     trainer.open_weight_sync(plan)  and  worker_i.open_weight_sync(plan, i)  (i = 1..N), concurrently
  per push   ann = trainer.publish_weights(version); worker_i.receive_weights(ann, version) -> seconds;
             trainer.send_weights(version) (moves the bytes for broadcast and, on x86, shared memory;
             no-op otherwise), all three concurrently
  shutdown   trainer.close_weight_sync(); worker_i.close_weight_sync()
`WeightSync` (session.py) makes exactly these calls on Ray actor handles. The workers' receiving
end is `titanrl.rollout.weight_receiver.WeightReceiver` (the rollout side's, next to the engine).
"""

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.layout import WeightLayout, WeightSyncError, build_layout, layout_of
from titanrl.weight_sync.plan import TRANSPORTS, WeightSyncPlan, make_plan
from titanrl.weight_sync.sender import PassiveSender, make_sender
from titanrl.weight_sync.session import WeightPush, WeightSync
from titanrl.weight_sync.source import TensorsWeights

__all__ = [
    "TRANSPORTS", "PassiveSender", "TensorsWeights", "WeightAnnouncement",
    "WeightLayout", "WeightPush", "WeightSync", "WeightSyncError", "WeightSyncPlan",
    "build_layout", "layout_of", "make_plan", "make_sender",
]
