"""The GRPO trainer: recompute logprobs, advantages, clipped surrogate, AdamW steps.

One trainer for every world size and device. It always runs over a `ParallelModel`: in one
process that is the whole model on the device (no mesh, no collective); in a parallel layout
each rank's `GRPOTrainer` (a `ParallelTrainerRank` actor) holds its shard, and every method
below is a collective that all ranks call in the same order (`TrainerGroup` sees to that).
The micro-batch loop, padding trim, finite check, clip and optimizer step live once, in
`GRPOStep`; this class adds packing, minibatches, PPO epochs, skip rules, metrics,
checkpoints and weight publishing.

Plain Python class; the driver runs it as a Ray actor (`ray.remote(GRPOTrainer)`), and unit
tests use it in-process.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from titanrl.models.architectures import spec_for
from titanrl.busy_flags import BusyFlags
from titanrl.config.parallel import check_compile, check_idle_threads, uses_onednn_linears
from titanrl.config.resolve import heap_mmap_threshold_mib as resolved_heap_threshold
from titanrl.config.schema import ModelConfig, ParallelConfig, TrainConfig, compute_dtype
from titanrl.config.validation import check_lora, lora_targets
from titanrl.config.unplanned import concrete_train
from titanrl.errors import ConfigError
from titanrl.memory import LARGE_MODEL_PARAMS, auto_heap_mmap_threshold_mib, peak_rss_gib, set_heap_mmap_threshold
from titanrl.models.hf_checkpoint import CheckpointError, load_state_dict_into, save_checkpoint
from titanrl.models.common.lora import LoraRecord, describe
from titanrl.models.peft_adapter import EXPORT_ADAPTER_DIR, save_peft_adapter
from titanrl.trainer import checkpoint as ckpt_io
from titanrl.trainer.batch import PackedBatch, advantages, minibatch_row_ranges, pack
from titanrl.trainer.idle_cores import IdleCores
from titanrl.trainer.kl import kl_metrics, kl_reward_penalty
from titanrl.trainer.losses.measures import combine_passes, loss_metrics
from titanrl.trainer.lr_schedule import build_scheduler, load_scheduler_state
from titanrl.trainer.optimizer import build_optimizers
from titanrl.trainer.parallel.checkpoint import load_model_optim, save_training_checkpoint
from titanrl.trainer.parallel.gather import GatheredWeights, full_adapters, iter_full_weights
from titanrl.trainer.parallel.mesh import barrier, build_mesh, global_rank, init_distributed, resolve_device_type
from titanrl.trainer.step import GRPOStep
from titanrl.trainer.policy import build_policy
from titanrl.trainer.reference import REFERENCE_STATE_KEY, ReferencePolicy, build_reference, reference_source
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.stats import GradStats, LogprobParity
from titanrl.types import Group, PolicyVersion
from titanrl.weight_sync.plain_tensors import PlainTensors
from titanrl.weight_sync.source import TensorsWeights
from titanrl.models.qwen3.moe import routing_buffers, zero_routing_buffers

if TYPE_CHECKING:
    from titanrl.weight_sync import WeightAnnouncement, WeightSyncPlan

PUSH_BUCKET_BYTES = 64 << 20
"""Bucket size of the weight gather: the only full tensors alive at once besides what rank 0 keeps."""


class GRPOTrainer:
    """Owns the policy, optimizer and lr schedule; `step` consumes groups and returns metrics.

    `model_config.checkpoint` is an HF checkpoint directory or a training checkpoint written by
    `save_state` (then the policy is rebuilt from it; call `load_state` for the rest). With
    train.kl.coef > 0 the trainer also holds the frozen reference policy (`reference`).
    """

    def __init__(self, setup: TrainerSetup, *, busy_flags: str | None = None) -> None:
        """Loads `setup.model`'s policy onto the device; for a parallel layout, joins the world (blocks
        until every rank has) and loads only this rank's shards (no rank holds the full model).

        On device 'xla' (a process with torch_xla) one process drives the SPMD mesh of train.parallel
        (titanrl.trainer.xla) and each optimizer step is one compiled program per shape bucket.
        busy_flags: the run's `titanrl.busy_flags` file, which train.compute.threads_when_rollouts_idle reads
        (the driver makes it); None: the trainer keeps train.compute.threads.
        A parallel layout (`train.parallel.world_size > 1`) needs the torch.distributed env vars
        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) set: `ParallelTrainerRank` does.
        """
        model_config, temperature, seed = setup.model, setup.temperature, setup.seed
        train_config = concrete_train(setup.train)  # 'auto' memory settings a driver did not plan
        batch_invariant, truncation = setup.batch_invariant, setup.truncation
        device_type = resolve_device_type(
            train_config.compute.device if setup.device_type is None else setup.device_type
        )
        if device_type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("train.compute.device='cuda' but this process sees no GPU (torch.cuda.is_available() is "
                              "False): set train.compute.device='cpu' or 'auto'")
        check_compile(train_config, batch_invariant, device_type)
        check_lora(setup.lora, train_config, device_type)
        check_idle_threads(train_config, batch_invariant, device_type)
        onednn_linears = uses_onednn_linears(train_config, batch_invariant, device_type,
                                             compute_dtype(model_config, train_config))
        # Same order on every rank, so rank 0 matches a single-process run.
        torch.manual_seed(seed)
        torch.set_num_threads(train_config.compute.threads)
        # Before the first large tensor. Auto (None) holds the large-model value while the weights
        # load and settles once the policy's size is known (below).
        threshold = train_config.memory.heap_mmap_threshold_mib
        set_heap_mmap_threshold(auto_heap_mmap_threshold_mib(LARGE_MODEL_PARAMS) if threshold is None else threshold)
        self.cfg = train_config
        self.temperature = temperature
        self.dtype = getattr(torch, model_config.dtype)
        """Storage dtype (model.dtype): parameters, optimizer state, checkpoints and HF exports."""
        self.compute_dtype = getattr(torch, compute_dtype(model_config, train_config))
        """Dtype of the forward/backward (train.compute.dtype, else model.dtype) and of the weights
        pushed to the generators, which compute in it too."""
        layout_options = dict(compute_dtype=self.compute_dtype,
                              activation_checkpointing=train_config.memory.activation_checkpointing,
                              activation_checkpointing_every=train_config.memory.activation_checkpointing_every,
                              compile_blocks=train_config.compute.compile, onednn_linears=onednn_linears)
        parallel = train_config.parallel
        self.xla = None
        """The XLA runtime (titanrl.trainer.xla.runtime.XlaRuntime) on train.compute.device='xla', else None."""
        if device_type == "xla":
            self.xla = _open_xla(model_config, train_config, batch_invariant)
            parallel = ParallelConfig()  # torch sees one process; the degrees shape the SPMD mesh
        policy: str | ckpt_io.InitialPolicy = model_config.checkpoint
        mesh = None
        if parallel.world_size > 1:
            # Config and tensor names / shapes are checked before joining the world; then each
            # rank builds the model on the meta device and reads only its shards.
            policy = ckpt_io.open_initial_policy(model_config.checkpoint)
            init_distributed(device_type)
            mesh = build_mesh(parallel, device_type)
        self.pm, self.model_config, self.tokenizer_dir = build_policy(policy, self.dtype, parallel, mesh, device_type,
                                                                      lora=setup.lora, seed=seed, **layout_options)
        self.lora: LoraRecord | None = None
        """The policy's low-rank adapters (setup.lora with rank > 0), else None: full fine-tuning."""
        self.push_adapters_only = setup.lora.rank > 0 and setup.lora.sync == "adapter"
        """lora.sync='adapter': pushes carry the adapters alone (the workers merge them themselves)."""
        if setup.lora.rank > 0:
            self.lora = LoraRecord(setup.lora.rank, setup.lora.alpha, lora_targets(setup.lora, self.model_config),
                                   str(Path(model_config.checkpoint).absolute()))
        if self.xla is not None:
            self.xla.check_model(self.model_config)
            self.xla.shard_model(self.pm.parts[0])
        if train_config.memory.heap_mmap_threshold_mib is None:
            set_heap_mmap_threshold(heap_mmap_threshold_mib(train_config, self.pm.parts))
        self.pad_id = self.model_config.eos_token_id or 0
        self.rank = global_rank()
        self.optimizers = build_optimizers(self.pm, train_config)
        self.schedulers = [build_scheduler(opt, train_config) for opt in self.optimizers]
        self.grpo = GRPOStep(self.pm, self.optimizers, train_config, temperature, batch_invariant,
                                     truncation, xla=self.xla)
        # The reference scores tokens under the same (truncated) distribution as the policy.
        self._build_reference = functools.partial(build_reference, policy=self.pm, dtype=self.dtype,
                                                  train_config=train_config, temperature=temperature,
                                                  batch_invariant=batch_invariant, truncation=truncation,
                                                  device_type=device_type, **layout_options)
        self.reference: ReferencePolicy | None = (
            self._build_reference(*reference_source(model_config.checkpoint)) if train_config.kl.coef > 0 else None)
        """The frozen reference policy of train.kl.coef (titanrl.trainer.reference); None when 0."""
        self._init_expert_bias()
        self.idle_cores: IdleCores | None = None
        """train.compute.threads_when_rollouts_idle at work (None: off, or no busy_flags file)."""
        if busy_flags is not None and train_config.compute.threads_when_rollouts_idle is not None:
            self.idle_cores = IdleCores(BusyFlags(busy_flags), train_config.compute.threads,
                                        train_config.compute.threads_when_rollouts_idle)
            self.idle_cores.install(self.pm.parts[0].decoder_layers(),
                                    spec_for(self.pm.config).parallel_plan.attention_core)
        self.version: PolicyVersion = 0
        self.skipped_steps = 0
        """`step` calls whose every optimizer step was skipped (non-finite loss or grad norm)."""
        self.consecutive_skipped = 0
        """Skipped `step` calls since the last call that updated the policy."""

    @property
    def device(self) -> torch.device:
        """Where the policy, its optimizer state and the batches live."""
        return self.pm.device

    @property
    def token_logprobs(self):  # noqa: ANN201 (a function of logits, targets, temperature)
        """The logprob function of this trainer's mode (batch-invariant kernels or plain torch), on
        full logits: the unchunked reference of what the step computes chunk by chunk."""
        return self.grpo.token_logprobs

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The AdamW of the policy, param groups decay / no_decay (titanrl.trainer.optimizer; a
        pipeline rank has one per stage: `optimizers`)."""
        if len(self.optimizers) != 1:
            raise AttributeError("a pipelined trainer has one optimizer per stage (trainer.optimizers)")
        return self.optimizers[0]

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        """The lr schedule (a pipeline rank has one per stage optimizer, all in step)."""
        return self.schedulers[0]

    @property
    def model(self) -> torch.nn.Module:
        """The policy on this rank (FSDP/TP-sharded in a parallel layout); a pipeline has stages instead."""
        if self.pm.pipelined:
            raise AttributeError("a pipelined trainer holds stages (trainer.pm.parts), not one model")
        return self.pm.parts[0]

    # ------------------------------------------------------------------------- gradients

    def accumulate_gradients(self, batch: PackedBatch, proximal_BT: torch.Tensor | None = None) -> GradStats:
        """Leaves in `.grad` the gradient of the batch's loss (train.loss.aggregation); no optimizer step.

        With `train.off_policy.decoupled_loss`, `proximal_BT` holds the logprobs before this step's first
        update (None: this forward is at those weights). See `GRPOStep.accumulate_gradients`.
        """
        if proximal_BT is not None:
            batch = dataclasses.replace(batch, proximal_BT=proximal_BT)
        return self.grpo.accumulate_gradients(batch)

    def proximal_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """The current weights' logprobs of every target token (the proximal policy of the
        decoupled loss and of train.off_policy.correction)."""
        return self.grpo.batch_logprobs(batch)

    def measure_parity(self, batch: PackedBatch) -> LogprobParity:
        """Trainer vs generator logprobs on the current-weights rows, without a backward."""
        return self.grpo.measure_parity(batch)

    def optimizer_step(self, stats: GradStats) -> tuple[float, float, bool]:
        """Clips and applies the accumulated gradient, then the lr schedule; skips both when loss or
        norm is non-finite. Returns (token-mean loss, pre-clip grad norm, taken)."""
        loss, norm, taken = self.grpo.clip_and_step(stats)
        self._schedule(taken)
        return loss, norm, taken

    def accumulate_and_step(self, batch: PackedBatch, proximal_BT: torch.Tensor | None = None
                            ) -> tuple[GradStats, float, float, bool]:
        """`accumulate_gradients` then `optimizer_step` (on XLA one compiled program):
        (stats, loss, pre-clip grad norm, taken)."""
        if proximal_BT is not None:
            batch = dataclasses.replace(batch, proximal_BT=proximal_BT)
        stats, loss, norm, taken = self.grpo.accumulate_and_step(batch)
        self._schedule(taken)
        return stats, loss, norm, taken

    def _schedule(self, taken: bool) -> None:
        if taken:
            for scheduler in self.schedulers:
                scheduler.step()

    # ------------------------------------------------------------------------- step

    def prepare_batch(self, groups: list[Group]) -> PackedBatch:
        """The groups packed for `step`: tokens, masks, generator logprobs and advantages; with a
        reference policy (train.kl.coef > 0) its logprobs (one no-grad forward), and with
        train.kl.in_reward the advantages of the rewards less kl_coef x each sample's KL."""
        scale = self.grpo.loss.scale_by_std  # train.loss.scale_advantages_by_std, resolved for train.loss.objective
        batch = pack(groups, self.pad_id, scale, current_version=self.version)
        if self.reference is None:
            return batch
        batch = dataclasses.replace(batch, reference_BT=self.reference.logprobs(batch))
        if self.cfg.kl.in_reward:
            batch = dataclasses.replace(batch, advantages_B=advantages(groups, scale, kl_reward_penalty(batch, self.cfg)))
        return batch

    def step(self, groups: list[Group]) -> dict[str, float] | None:
        """One policy update (version + 1) from rollout groups; returns its metrics.

        Advantages come once per group; the old logprobs of the PPO ratio are the generator's.
        The call makes `ppo_epochs` passes; each splits the groups into `minibatches` contiguous
        parts of whole groups and takes one optimizer step per part (its loss averaged as
        train.loss.aggregation says).
        An optimizer step whose loss or gradient norm is not finite is skipped; if all are, the
        call is a skipped step: the version stays and `train/skipped` is 1.

        Metrics:
          loss, grad_norm: mean over the call's optimizer steps taken of the minibatch loss (its
            train.loss.aggregation average, entropy bonus included) and of the pre-clip gradient
            norm; in a skipped call, mean over the skipped ones
            (non-finite, which is why they were skipped).
          lr: learning rate of the call's last optimizer step (the one it would have used, if skipped).
          train/clip_fraction: clipped / tokens over every forward of the call (all passes).
          loss/*, offpolicy/*: what the loss clipped, masked or truncated, over the same forwards
            (titanrl.trainer.losses.measures.loss_metrics says which appear for which loss).
          train/entropy: token-mean entropy of the trainer's sampling distribution softmax(logits /
            temperature) (truncated and renormalised under top-k / top-p) over the trained tokens of
            every forward of the call (all passes).
          train/truncation_outside_frac (top-k / top-p only): the share of those tokens whose target
            was outside the trainer's kept set (scored over the kept set plus the target).
          train/rollouts_idle_frac (train.compute.threads_when_rollouts_idle, with the run's busy flags): the
            share of the call's thread checks (one per decoder layer, forward and backward) that found
            every rollout worker idle, so ran on train.compute.threads_when_rollouts_idle threads.
          train/mismatch_mean_abs, train/mismatch_max_abs: |trainer - generator| logprob on the
            first minibatch of the first pass, the only forward at the generator's weights.
          train/tokens: trained tokens in the groups; train/advantage_nonzero_frac.
          train/optimizer_steps, train/skipped_optimizer_steps: taken / skipped in this call.
          train/skipped: 1.0 when the call was skipped; train/skipped_steps: skipped calls so far;
          train/consecutive_skipped: skipped calls since the last update; policy_version: after it.
          memory/trainer_peak_gib: peak resident memory of this (rank 0's) process so far.
          xla/compiles, xla/compile_s (train.compute.device='xla'): programs torch_xla compiled since the
            trainer was built, and their seconds (one per shape bucket, plus the first step's).
          With train.kl.coef > 0 (titanrl.trainer.kl.kl_metrics): kl/mean, kl/max: token-mean and
            max of the train.kl.estimator estimate of KL(pi || pi_ref) over the batch's trained
            tokens, pi's logprobs being the generator's; with train.kl.in_reward,
            kl/reward_penalty: mean over samples of kl_coef x their summed KL (taken off the rewards).
          Mixture-of-experts policies (not pipelined) add (titanrl.trainer.moe):
          moe/route_agreement: fraction of the generator-recorded completion tokens (x sparse
            layers) whose trainer top-k set, from its live scores (also when replaying), equals the
            generator's, on the first minibatch of the first pass (at the generator's weights); NaN
            when nothing was recorded; moe/route_tokens_compared: how many were compared;
            moe/route_agreement_used: the same for the experts the forward used (1.0 when replaying).
          moe/load_max_over_mean: max over experts of the tokens routed to it over their mean, per
            sparse layer, averaged over the layers, over every forward of the call.
          moe/aux_loss: HF's load-balancing loss (unscaled by its coefficient), mean over the
            call's gradient passes (measured whatever train.moe.load_balance).
        In a parallel layout every rank must call it; rank 0 returns the metrics, the others None.
        """
        if not groups:
            raise ValueError("GRPOTrainer.step needs at least one group")
        start = time.perf_counter()
        if self.idle_cores is not None:
            self.idle_cores.check()  # before the batch's first tensors
        batch = self.prepare_batch(groups)
        ranges = minibatch_row_ranges([len(g.samples) for g in groups], self.cfg.minibatches)
        # With one minibatch the first forward sees every row at the generator's weights;
        # with several, later minibatches run after an update, so measure parity up front.
        parity = self.measure_parity(batch) if len(ranges) > 1 else None
        several_updates = len(ranges) > 1 or self.cfg.ppo_epochs > 1
        # The batch-start weights' logprobs, when the loss takes its ratio around them.
        proximal = self.proximal_logprobs(batch) if self.grpo.loss.at_proximal and several_updates else None
        taken_loss, taken_norm, skipped_loss, skipped_norm = [], [], [], []
        clipped = seen_tokens = entropy = outside = 0.0
        first: GradStats | None = None
        moe_passes: list = []
        loss_passes: list[dict[str, float]] = []
        lr = self.scheduler.get_last_lr()[0]
        for _ in range(self.cfg.ppo_epochs):
            for lo, hi in ranges:
                lr = self.scheduler.get_last_lr()[0]
                stats, loss, norm, taken = self.accumulate_and_step(batch.rows(lo, hi),
                                                                    None if proximal is None else proximal[lo:hi])
                if first is None:
                    first = stats
                clipped += stats.clipped_tokens
                entropy += stats.entropy_sum
                outside += stats.truncation_outside_tokens
                if stats.moe is not None:
                    moe_passes.append(stats.moe)
                loss_passes.append(stats.loss_measures)
                seen_tokens += stats.tokens
                (taken_loss if taken else skipped_loss).append(loss)
                (taken_norm if taken else skipped_norm).append(norm)
        skipped = not taken_loss
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skipped += 1
        else:
            self.version += 1
            self.consecutive_skipped = 0
        losses, norms = (skipped_loss, skipped_norm) if skipped else (taken_loss, taken_norm)
        assert first is not None
        parity = parity or first.parity
        if self.rank != 0:
            return None  # every rank computed the same numbers; rank 0 reports them
        truncated = {} if self.grpo.truncation is None else {"train/truncation_outside_frac": outside / seen_tokens}
        if self.idle_cores is not None:
            truncated["train/rollouts_idle_frac"] = self.idle_cores.take_idle_fraction()
        return {
            **parity.metrics(),
            **truncated,
            **_moe_metrics(moe_passes),
            **loss_metrics(self.grpo.loss, combine_passes(loss_passes), seen_tokens),
            **(kl_metrics(batch, self.cfg) if self.reference is not None else {}),
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(norms) / len(norms),
            "lr": lr,
            "train/clip_fraction": clipped / seen_tokens,
            "train/entropy": entropy / seen_tokens,
            # Trainer-vs-generator logprob gap at the generator's weights version: the
            # train/inference mismatch plus any staleness.
            "train/mismatch_mean_abs": first.abs_logprob_diff_sum / first.tokens,
            "train/mismatch_max_abs": first.max_abs_logprob_diff,
            "train/tokens": batch.loss_mask_BT.sum().item(),
            "train/advantage_nonzero_frac": (batch.advantages_B != 0).float().mean().item(),
            "train/optimizer_steps": float(len(taken_loss)),
            "train/skipped_optimizer_steps": float(len(skipped_loss)),
            "train/skipped": 1.0 if skipped else 0.0,
            "train/skipped_steps": float(self.skipped_steps),
            "train/consecutive_skipped": float(self.consecutive_skipped),
            "policy_version": float(self.version),
            "time/train_s": time.perf_counter() - start,
            # Rank 0's process (in a parallel layout the others hold an equal share).
            "memory/trainer_peak_gib": peak_rss_gib(),
            **(self.xla.compile_metrics() if self.xla is not None else {}),
        }

    # ------------------------------------------------------------------------- weights out

    def _init_expert_bias(self) -> None:
        """Zero float32 router biases on the device (a dtype cast of the model must not round
        their updates)."""
        for part in self.pm.parts:
            zero_routing_buffers(part, self.device)

    def state_dict_for_push(self) -> dict[str, torch.Tensor] | None:
        """HF-named full CPU tensors for rollout workers in the generator's dtype (the compute
        dtype; tied head omitted, as in HF files), gathered bucket by bucket in a parallel layout:
        rank 0 gets them, the others None. With train.moe.load_balance='bias' the routers'
        float32 expert biases come too (`_pushed_buffers`). They cross to the workers as plain bytes
        (`PlainTensors`): this actor may run on another torch version (train.compute.device='xla')."""
        if self.push_adapters_only:
            adapters = self._adapter_tensors()  # every rank: a sharded factor is gathered
            return PlainTensors({k: v.to("cpu", copy=True) for k, v in adapters.items()}) if self.rank == 0 else None
        out = self._full_state_dict(self.compute_dtype)
        if out is not None:
            out.update({k: v.detach().to("cpu", copy=True) for k, v in self._pushed_buffers().items()})
        return PlainTensors(out) if out is not None else None

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """lora.sync='adapter': the adapter factors, whole (gathered from their FSDP / TP shards: call
        on every rank), in the generator's dtype, as the forward casts them (the workers compute
        the same unmerged LoRA term beside their frozen base)."""
        return full_adapters(self.pm.parts, self.compute_dtype)

    def _full_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        out: dict[str, torch.Tensor] = {}
        for bucket in iter_full_weights(self.pm, PUSH_BUCKET_BYTES, dtype, self._to_host()):
            for name, tensor in bucket:
                # A copy: an unsharded tensor shares storage with the live parameter.
                out[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return out if self.rank == 0 else None

    def get_version(self) -> PolicyVersion:
        return self.version

    def save(self, out_dir: str) -> str | None:
        """Exports the current policy as an HF checkpoint directory (tokenizer included), written
        by rank 0 (which returns its path; the others None), in the storage dtype (model.dtype)."""
        weights = self._full_state_dict(self.dtype)
        adapters = full_adapters(self.pm.parts) if self.lora is not None else {}  # every rank: gathers
        path = None
        if self.rank == 0 and any(bool(b.any()) for b in self._pushed_buffers().values()):
            # An HF Qwen3-MoE checkpoint has no tensor for it: the export routes without it.
            warnings.warn("the HF export leaves out the routers' expert biases (train.moe.load_balance='bias'): "
                          "Qwen3-MoE checkpoints have no such tensor, so the exported model chooses experts "
                          "without them; resume from a training checkpoint (save_state) to keep them",
                          stacklevel=2)
        if self.rank == 0:
            model = ckpt_io.empty_model(self.model_config, self.dtype)
            load_state_dict_into(model, weights, source="the trainer's policy")
            path = str(save_checkpoint(model, out_dir, tokenizer_dir=self.tokenizer_dir))
            if self.lora is not None:  # the adapters too, for `titanrl export` to write them in PEFT's format
                save_peft_adapter(adapters, self.lora, Path(path) / EXPORT_ADAPTER_DIR)
        barrier(self.pm.mesh)
        return path

    # ------------------------------------------------------------------------- full state

    def save_state(self, dir: str) -> None:
        """Writes everything an exact resume needs into `dir` (layout: titanrl.trainer.checkpoint),
        collectively in a parallel layout (DCP shards from every rank; loads into any layout)."""
        Path(dir).mkdir(parents=True, exist_ok=True)
        stepped = any(bool(opt.state) for opt in self.optimizers)
        pm, optimizers = self._checkpoint_view()
        save_training_checkpoint(pm, optimizers, dir, dtype=self.dtype, tokenizer_dir=self.tokenizer_dir,
                                 trainer_state=self.trainer_state(stepped))

    def _checkpoint_view(self) -> tuple[Any, list[torch.optim.Optimizer]]:
        """The policy and optimizers the checkpoint code reads and writes: the live ones, or on
        XLA their CPU copies (titanrl.trainer.xla.checkpoint)."""
        if self.xla is None:
            return self.pm, self.optimizers
        from titanrl.trainer.xla.checkpoint import host_copy

        return host_copy(self.pm, self.optimizers, self.cfg)

    def trainer_state(self, optimizer_stepped: bool) -> dict:
        """Everything but model and optimizer that an exact resume needs (trainer_state.pt)."""
        return {
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped": self.consecutive_skipped,
            "optimizer_stepped": optimizer_stepped,
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt_io.rng_state(),
            **({ckpt_io.LORA_STATE_KEY: self.lora.to_dict()} if self.lora is not None else {}),
            **({REFERENCE_STATE_KEY: self.reference.checkpoint} if self.reference is not None else {}),
        }

    def open_checkpoint(self, dir: str) -> tuple[Path, dict]:
        """A training checkpoint's directory and trainer state, after checking it holds this model."""
        ckpt = ckpt_io.check_training_checkpoint(dir)
        config, dtype = ckpt_io.read_hf_config(ckpt)
        if config != self.model_config:
            raise CheckpointError(
                f"{str(ckpt)!r} holds a different model than the trainer's: {config} vs {self.model_config}"
            )
        if dtype != self.dtype:
            raise CheckpointError(
                f"{str(ckpt)!r} was trained in {dtype}; set model.dtype to match (it is {self.dtype})"
            )
        state = ckpt_io.read_trainer_state(ckpt)
        saved = ckpt_io.lora_record(ckpt, state)
        if (saved and saved.adapters) != (self.lora and self.lora.adapters):
            raise CheckpointError(f"{str(ckpt)!r} was trained with {describe(saved)}, this trainer has "
                                  f"{describe(self.lora)}: set the lora section to match")
        return ckpt, state

    def restore_counters(self, state: dict) -> int:
        """Version, skip counters and RNG from a trainer state; returns the version."""
        self.version = state["version"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skipped = state["consecutive_skipped"]
        ckpt_io.set_rng_state(state["rng"])
        return self.version

    def load_state(self, dir: str) -> int:
        """Restores a `save_state` directory written under any layout (weights, optimizer, schedule,
        counters, RNG); returns the version."""
        ckpt, state = self.open_checkpoint(dir)
        pm, optimizers = self._checkpoint_view()
        load_model_optim(pm, optimizers, ckpt / ckpt_io.MODEL_OPTIM_DIR, optimizer_stepped=state["optimizer_stepped"])
        if self.xla is not None:
            from titanrl.trainer.xla.checkpoint import copy_to_device

            copy_to_device(self.pm, self.optimizers, pm, optimizers)
        for scheduler in self.schedulers:
            load_scheduler_state(scheduler, state["scheduler"])
            # Param groups of older optimizer formats are not loaded (load_model_optim):
            # the schedule's current lr is the one the next step must use.
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        self._restore_reference(state, ckpt)
        if self.lora is not None:  # the frozen base came from where the saved run's did
            self.lora = ckpt_io.lora_record(ckpt, state)
        return self.restore_counters(state)

    def _restore_reference(self, state: dict, ckpt: Path) -> None:
        """Rebuilds the reference from the checkpoint the saved run recorded, when it is another."""
        recorded = state.get(REFERENCE_STATE_KEY)
        if self.reference is None or recorded is None or recorded == self.reference.checkpoint:
            return
        self.reference = None  # freed before the other is loaded
        self.reference = self._build_reference(recorded, recorded_in=str(ckpt / ckpt_io.TRAINER_STATE_FILE))

    # ------------------------------------------------------------------------- weight sync

    def open_weight_sync(self, plan: WeightSyncPlan) -> None:
        """Sets up the transport `publish_weights` uses (titanrl.weight_sync). For 'broadcast' it
        returns once every worker has joined the group: run the workers' `open_weight_sync(plan,
        rank)` concurrently. Without this call, pushes go through the object store."""
        self.close_weight_sync()
        self._weight_sender = self._make_weight_sender(plan)

    def publish_weights(self, version: int) -> WeightAnnouncement | None:
        """Publishes the current weights as `version`; the announcement goes to every worker's
        `receive_weights`. `send_weights(version)` must follow (broadcast and shared memory move
        the bytes there, while the workers receive)."""
        return self._weight_sync_sender().publish(version, self._weight_source())

    def send_weights(self, version: int) -> float:
        """Moves the version just published, while the workers receive it (broadcast: streams it;
        shared memory on x86: writes it, the workers copying behind); returns seconds (0.0 when
        the transport has nothing to do here)."""
        return self._weight_sync_sender().send(version, self._weight_source())

    def close_weight_sync(self) -> None:
        """Releases the transport (unlinks shared memory, leaves the group); idempotent."""
        sender = getattr(self, "_weight_sender", None)
        self._weight_sender = None
        if sender is not None:
            sender.close()

    def _make_weight_sender(self, plan: WeightSyncPlan) -> Any:
        """Rank 0 sends; the other ranks only join the gathers, in the same call as rank 0."""
        from titanrl.weight_sync import PassiveSender, make_sender

        return make_sender(plan) if self.rank == 0 else PassiveSender(plan)

    def _weight_sync_sender(self) -> Any:
        if getattr(self, "_weight_sender", None) is None:
            from titanrl.weight_sync import make_plan

            self._weight_sender = self._make_weight_sender(make_plan("object_store", 1))
        return self._weight_sender

    def _weight_source(self) -> GatheredWeights:
        """The weights as the senders read them: views of the live parameters in one process,
        full tensors gathered to rank 0 bucket by bucket in a parallel layout (no full copy first);
        in the generator's dtype (casts of the master weights under mixed precision)."""
        if self.push_adapters_only:  # the factors, a few MB: gathered whole on every rank now
            return TensorsWeights(self._adapter_tensors())
        return GatheredWeights(self.pm, self.compute_dtype, PUSH_BUCKET_BYTES, self._pushed_buffers(),
                               self._to_host())

    def _to_host(self) -> Any:
        """How full tensors leave the device for a push or an export: as they are, or on XLA shard
        by shard (XlaRuntime.to_host; a sharded tensor's own `.cpu()` compiles on every call)."""
        return self.xla.to_host if self.xla is not None else None

    def _pushed_buffers(self) -> dict[str, torch.Tensor]:
        """Non-parameter tensors the generators need: with train.moe.load_balance='bias', the
        routers' expert biases (float32; the generator's routers choose experts with them too)."""
        if self.cfg.moe.load_balance != "bias":
            return {}
        return {name: buf for part in self.pm.parts for name, buf in routing_buffers(part).items()}


def _open_xla(model_config: ModelConfig, train_config: TrainConfig, batch_invariant: bool) -> Any:
    """The XLA runtime for train.compute.device='xla', after refusing what the XLA trainer does not run."""
    from titanrl.config.xla_env import check_xla_training

    check_xla_training(train_config, batch_invariant)
    from titanrl.trainer.xla.runtime import XlaRuntime

    return XlaRuntime(train_config.parallel)


def _moe_metrics(passes: list) -> dict[str, float]:
    """The moe/* metrics of a step's gradient passes (titanrl.trainer.moe.MoeStats); none for a dense policy."""
    if not passes:
        return {}
    first = passes[0]
    total = passes[0].load.clone()
    for p in passes[1:]:
        total += p.load
    load = dataclasses.replace(first, load=total)
    return {
        "moe/route_agreement": first.route_agreement,
        "moe/route_tokens_compared": first.tokens_compared,
        "moe/route_agreement_used": first.used_agreement,
        "moe/load_max_over_mean": load.load_max_over_mean,
        "moe/aux_loss": sum(p.aux_loss for p in passes) / len(passes),
    }


def heap_mmap_threshold_mib(train_config: TrainConfig, parts: list[torch.nn.Module]) -> int:
    """train.memory.heap_mmap_threshold_mib by `resolve`'s rule, counting the parameters of `parts` (the
    policy's modules on this rank; a DTensor counts at its full size). A run's config arrives resolved;
    a trainer built by hand with None gets the same value here."""
    return resolved_heap_threshold(train_config, sum(p.numel() for part in parts for p in part.parameters()))
