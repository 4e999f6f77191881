"""One rank of the parallel trainer: a Ray actor that joins a torch.distributed world.

`ParallelTrainerRank` is a `GRPOTrainer` whose model is this rank's share of a parallelized
policy: it keeps GRPOTrainer.step (packing, minibatches, PPO epochs, skip rules, metrics) and
replaces the parts that touch the model (gradients, parity, optimizer step, weights out,
checkpoints) with their distributed versions. Every rank gets every call, in the same order
(`titanrl.trainer.trainer_group.TrainerGroup` sees to that); the calls are collective.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from titanrl.config import ModelConfig, TrainConfig
from titanrl.models.hf_checkpoint import load_state_dict_into, save_checkpoint
from titanrl.trainer import checkpoint as ckpt_io
from titanrl.trainer.lr_schedule import build_scheduler
from titanrl.trainer.parallel.checkpoint import load_model_optim, save_training_checkpoint
from titanrl.trainer.parallel.gather import iter_full_weights
from titanrl.trainer.parallel.mesh import build_mesh, init_distributed
from titanrl.trainer.parallel.parallelize import build_optimizers, parallelize
from titanrl.trainer.parallel.step import ParallelGRPOStep
from titanrl.trainer.trainer import GradStats, GRPOTrainer, LogprobParity, PackedBatch
from titanrl.types import Group

PUSH_BUCKET_BYTES = 64 << 20
"""Bucket size of the weight gather: the only full tensors alive at once besides what rank 0 keeps."""


class ParallelTrainerRank(GRPOTrainer):
    """This process's rank of a parallel GRPO trainer (run it as a Ray actor, one per rank).

    Methods that return data (step's metrics, the pushed state dict, save's path) return it on
    rank 0 and None elsewhere, except get_version and load_state, which every rank answers.
    """

    def __init__(
        self, rank: int, world_size: int, master_addr: str, master_port: int, device_type: str,
        model_config: ModelConfig, train_config: TrainConfig, temperature: float, seed: int,
        batch_invariant: bool = False,
    ) -> None:
        """Loads the full policy, joins the world (blocks until every rank has), then shards it.

        device_type: 'cpu' (gloo) or 'cuda' (NCCL; the actor holds one GPU, so LOCAL_RANK is 0).
        """
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_RANK="0" if device_type == "cuda" else str(rank),
        )
        # The same initialisation as GRPOTrainer.__init__, so rank 0 matches a single-process run.
        torch.manual_seed(seed)
        torch.set_num_threads(train_config.threads)
        self.cfg = train_config
        self.temperature = temperature
        self.dtype = getattr(torch, model_config.dtype)
        # Loaded before the world exists: DCP then reads a training checkpoint on its own.
        model, self.model_config, self.tokenizer_dir = ckpt_io.load_initial_policy(
            model_config.checkpoint, self.dtype
        )
        self.pad_id = self.model_config.eos_token_id or 0
        init_distributed(device_type)
        self.rank = dist.get_rank()
        self.pm = parallelize(model, train_config.parallel, build_mesh(train_config.parallel, device_type))
        self.optimizers = build_optimizers(self.pm, train_config)
        self.schedulers = [build_scheduler(opt, train_config) for opt in self.optimizers]
        self.scheduler = self.schedulers[0]  # GRPOTrainer.step reads the lr from here; all agree
        self.grpo = ParallelGRPOStep(self.pm, self.optimizers, train_config, temperature, batch_invariant)
        self.version = 0
        self.skipped_steps = 0
        self.consecutive_skipped = 0

    def ready(self) -> int:
        """This actor's rank, once the world is joined and the model sharded."""
        return self.rank

    # ------------------------------------------------------------------------- GRPOTrainer hooks

    def accumulate_gradients(self, batch: PackedBatch, proximal_BT: torch.Tensor | None = None) -> GradStats:
        if proximal_BT is not None:  # config validation refuses decoupled_loss for a parallel trainer
            raise NotImplementedError("the parallel trainer has no decoupled loss (train.decoupled_loss)")
        return self.grpo.accumulate_gradients(batch)

    def measure_parity(self, batch: PackedBatch) -> LogprobParity:
        """Parity over the whole batch before any update, from a forward-only pass."""
        return self.grpo.measure_parity(batch)

    def _optimizer_step(self, stats: GradStats) -> tuple[float, float, bool]:
        loss, norm, taken = self.grpo.clip_and_step(stats)
        if taken:
            for scheduler in self.schedulers:
                scheduler.step()
        return loss, norm, taken

    def step(self, groups: list[Group]) -> dict[str, float] | None:  # type: ignore[override]
        metrics = super().step(groups)
        return metrics if self.rank == 0 else None

    # ------------------------------------------------------------------------- weights out

    def state_dict_for_push(self) -> dict[str, torch.Tensor] | None:  # type: ignore[override]
        """Rank 0: HF-named full CPU tensors (tied head omitted), gathered bucket by bucket."""
        out: dict[str, torch.Tensor] = {}
        for bucket in iter_full_weights(self.pm, PUSH_BUCKET_BYTES):
            for name, tensor in bucket:
                # A copy: an unsharded tensor may share storage with the live parameter.
                out[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return out if self.rank == 0 else None

    def save(self, out_dir: str) -> str | None:
        """Exports the current policy as an HF checkpoint directory (written by rank 0)."""
        weights = self.state_dict_for_push()
        path = None
        if self.rank == 0:
            model = ckpt_io.empty_model(self.model_config, self.dtype)
            load_state_dict_into(model, weights, source="the gathered parallel policy")
            path = str(save_checkpoint(model, out_dir, tokenizer_dir=self.tokenizer_dir))
        dist.barrier()
        return path

    # ------------------------------------------------------------------------- full state

    def save_state(self, dir: str) -> None:
        """GRPOTrainer.save_state's layout, written collectively (DCP shards from every rank)."""
        Path(dir).mkdir(parents=True, exist_ok=True)
        stepped = any(bool(opt.state) for opt in self.optimizers)
        save_training_checkpoint(
            self.pm, self.optimizers, dir, dtype=self.dtype, tokenizer_dir=self.tokenizer_dir,
            trainer_state=self.trainer_state(stepped),
        )

    def load_state(self, dir: str) -> int:
        """Restores a training checkpoint written under any layout (or by GRPOTrainer); returns the version."""
        ckpt, state = self.open_checkpoint(dir)
        load_model_optim(self.pm, self.optimizers, ckpt / ckpt_io.MODEL_OPTIM_DIR,
                         optimizer_stepped=state["optimizer_stepped"])
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state["scheduler"])
            # A GRPOTrainer checkpoint's param groups are not loaded (see load_model_optim):
            # the schedule's current lr is the one the next step must use.
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        return self.restore_counters(state)

    # ------------------------------------------------------------------------- weight sync hooks

    def _make_weight_sender(self, plan):  # type: ignore[no-untyped-def]
        """Rank 0 sends; the other ranks only join the gathers, in the same call as rank 0."""
        from titanrl.weight_sync import PassiveSender, make_sender

        return make_sender(plan) if self.rank == 0 else PassiveSender(plan)

    def _weight_source(self):  # type: ignore[no-untyped-def]
        """Full tensors gathered to rank 0 bucket by bucket, as they are sent (no full copy first)."""
        from titanrl.weight_sync import GatheredWeights

        return GatheredWeights(self.pm, self.dtype, PUSH_BUCKET_BYTES)
