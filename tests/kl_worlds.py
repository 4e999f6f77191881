"""Functions that tests/test_kl.py runs inside the session's shared 2-rank `gloo_world`."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from titanrl.config import ModelConfig, ParallelConfig, TrainConfig
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group


def reference_in_layout(rank: int, world_size: int, runs: dict[str, tuple[str, dict, dict, bool]],
                        groups: list[Group], temperature: float) -> dict[str, Any]:
    """For each named (model.checkpoint, layout, train config, step): a trainer in that layout, which
    load_state()s model.checkpoint when it is a training checkpoint; rank 0 returns its reference
    logprobs of `groups`, the version it resumed at and (step) the metrics of one step on them."""
    from titanrl.trainer.checkpoint import is_training_checkpoint

    out = {}
    for name, (checkpoint, layout, train, step) in runs.items():
        train = dict(train)  # runs may share one dict
        batch_invariant = train.pop("batch_invariant", False)
        config = TrainConfig(**train, parallel=ParallelConfig(**layout))
        tr = GRPOTrainer(
            TrainerSetup(
                ModelConfig(checkpoint=checkpoint), config, temperature, seed=0, batch_invariant=batch_invariant
            )
        )
        version = tr.load_state(checkpoint) if is_training_checkpoint(checkpoint) else 0
        out[name] = {"reference_BT": tr.prepare_batch(groups).reference_BT, "version": version,
                     "metrics": tr.step(groups) if step else None}
    return out if dist.get_rank() == 0 else {}
