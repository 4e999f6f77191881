"""Functions that run inside spawned gloo worlds for tests/test_moe_replay.py."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from titanrl.config import ParallelConfig, TrainConfig
from titanrl.trainer.batch import PackedBatch
from titanrl.trainer.optimizer import build_optimizers
from titanrl.trainer.parallel import ParallelGRPOStep, build_mesh, parallelize
from titanrl.trainer.parallel.gather import iter_full_gradients


def fsdp_replay_step(rank: int, world_size: int, state: dict, batch: PackedBatch, train: TrainConfig) -> dict[str, Any]:
    """One gradient pass of the tiny MoE policy (weights `state`) under dp_shard=world_size: rank
    0 returns the full gradients and the routing stats."""
    from moe_replay_cases import tiny_moe_model

    model = tiny_moe_model()
    model.load_state_dict(state)
    parallel = ParallelConfig(dp_shard=world_size)
    pm = parallelize(model, parallel, build_mesh(parallel, "cpu"))
    step = ParallelGRPOStep(pm, build_optimizers(pm, train), train, 1.0)
    stats = step.accumulate_gradients(batch)
    grads = {name: g.clone() for bucket in iter_full_gradients(pm) for name, g in bucket}
    return {"grads": grads, "moe": stats.moe} if dist.get_rank() == 0 else {}
