"""Functions that run inside spawned gloo worlds for tests/test_moe_replay.py."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from titanrl.config import ParallelConfig, TrainConfig
from titanrl.trainer.batch import PackedBatch
from titanrl.trainer.optimizer import build_optimizers
from titanrl.trainer.parallel import build_mesh, parallelize
from titanrl.trainer.step import GRPOStep
from titanrl.trainer.parallel.gather import iter_full_gradients


def replay_steps(rank: int, world_size: int, state: dict, batch: PackedBatch,
                 runs: dict[str, tuple[dict, TrainConfig]]) -> dict[str, Any]:
    """For each named (layout, train config): one gradient pass of the tiny MoE policy (weights
    `state`); rank 0 returns each run's full gradients and routing stats."""
    from moe_replay_cases import tiny_moe_model

    out = {}
    for name, (layout, train) in runs.items():
        model = tiny_moe_model()
        model.load_state_dict(state)
        parallel = ParallelConfig(**layout)
        pm = parallelize(model, parallel, build_mesh(parallel, "cpu"))
        step = GRPOStep(pm, build_optimizers(pm, train), train, 1.0)
        stats = step.accumulate_gradients(batch)
        grads = {n: g.clone() for bucket in iter_full_gradients(pm) for n, g in bucket}
        out[name] = {"grads": grads, "moe": stats.moe}
    return out if dist.get_rank() == 0 else {}
