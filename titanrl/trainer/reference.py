"""The frozen reference policy of the KL penalty (train.kl.coef > 0): the run's initial weights.

Held only when the penalty is on. Built through the policy's own path (`build_policy`: the same
layout, shards, storage and compute dtypes), then frozen: eval mode, no gradients, no optimizer.
Its logprobs come from the policy's micro-batch forward (`GRPOStep.batch_logprobs`), once
per step before the micro-batch loop, into `PackedBatch.reference_BT`; a mixture-of-experts
reference routes as that forward does (through the generator's experts with train.moe.router_replay).

Saved with the run as the path of its checkpoint (trainer_state.pt's `REFERENCE_STATE_KEY`), not
as a second copy of the weights: `GRPOTrainer.load_state`, under any layout, rebuilds the
reference from that directory, and a trainer whose model.checkpoint is a training checkpoint
that recorded one starts from it too (the first run's initial weights, not the checkpoint's
own). A recorded directory that is gone fails, naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from titanrl.config.schema import TrainConfig
from titanrl.models.hf_checkpoint import CheckpointError
from titanrl.models.qwen3.moe import zero_routing_buffers
from titanrl.trainer import checkpoint as ckpt_io
from titanrl.trainer.batch import PackedBatch
from titanrl.trainer.parallel.parallelize import ParallelModel
from titanrl.trainer.step import GRPOStep
from titanrl.trainer.policy import build_policy
from titanrl.trainer.truncation import Truncation

REFERENCE_STATE_KEY = "reference_checkpoint"
"""trainer_state.pt's entry naming the reference policy's checkpoint directory (absolute)."""


class ReferencePolicy:
    """The frozen reference: its checkpoint directory and a gradient-free step over its weights."""

    def __init__(self, checkpoint: str, step: GRPOStep) -> None:
        self.checkpoint = checkpoint
        """Absolute path of the directory the weights came from (what a resume rebuilds it from)."""
        self.step = step
        """`GRPOStep` over the frozen weights, without optimizers: only its forward is used."""

    @property
    def pm(self) -> ParallelModel:
        return self.step.pm

    def logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """The reference's logprobs of every target token, [B, T], the same on every rank."""
        return self.step.batch_logprobs(batch)


def reference_source(checkpoint: str) -> tuple[str, str | None]:
    """The directory a run starting from `checkpoint` (model.checkpoint) takes its reference from
    (absolute), and the trainer state that recorded it: the one a training checkpoint recorded,
    else `checkpoint` itself (and None)."""
    if ckpt_io.is_training_checkpoint(checkpoint):
        state_file = Path(checkpoint) / ckpt_io.TRAINER_STATE_FILE
        recorded = ckpt_io.read_trainer_state(Path(checkpoint)).get(REFERENCE_STATE_KEY)
        if recorded is not None:
            return recorded, str(state_file)
    return str(Path(checkpoint).absolute()), None


def build_reference(checkpoint: str, recorded_in: str | None = None, *, policy: ParallelModel, dtype: torch.dtype,
                    train_config: TrainConfig, temperature: float, batch_invariant: bool, device_type: str,
                    truncation: Truncation | None = None, **layout_options: Any) -> ReferencePolicy:
    """The frozen copy of the weights in `checkpoint` laid out like `policy` (call on every rank).

    recorded_in: the trainer state that named `checkpoint`, for the error if it is gone.
    """
    if not Path(checkpoint).is_dir():
        where = f" (recorded in {recorded_in})" if recorded_in else ""
        raise CheckpointError(
            f"the KL reference policy's checkpoint {checkpoint!r}{where} does not exist: train.kl.coef > 0 "
            f"needs the run's initial weights there (they are not copied into training checkpoints); "
            f"restore that directory, or set train.kl.coef=0"
        )
    pm, config, _ = build_policy(checkpoint, dtype, policy.parallel, policy.mesh, device_type, **layout_options)
    if config != policy.config:
        raise CheckpointError(f"the KL reference policy's checkpoint {checkpoint!r} holds a different model than "
                              f"the policy: {config} vs {policy.config}")
    for part in pm.parts:
        part.eval()
        part.requires_grad_(False)
        zero_routing_buffers(part, pm.device)  # float32 on the device, as the policy's (they stay zero)
    return ReferencePolicy(checkpoint, GRPOStep(pm, [], train_config, temperature, batch_invariant, truncation))
