"""The GRPO trainer: recompute logprobs, advantages, clipped surrogate, AdamW steps.

Plain Python class; the driver runs it as a Ray actor (`ray.remote(GRPOTrainer)`),
and unit tests use it in-process.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from titanrl.config import ModelConfig, TrainConfig
from titanrl.models.hf_checkpoint import CheckpointError, hf_state_dict, load_model, save_checkpoint
from titanrl.trainer import checkpoint as ckpt_io
from titanrl.trainer.grpo import clipped_surrogate_loss, group_advantages, token_logprobs
from titanrl.trainer.lr_schedule import build_scheduler
from titanrl.types import Group, PolicyVersion


@dataclass
class PackedBatch:
    """Right-padded token batch; position t of `targets` is predicted from `input_ids[:, :t+1]`."""

    input_ids_BT: torch.Tensor
    """Model inputs: prompt + completion minus its last token, right-padded."""
    targets_BT: torch.Tensor
    """Next-token targets of `input_ids_BT`."""
    loss_mask_BT: torch.Tensor
    """1.0 on completion targets the model generated; 0.0 on prompt, padding, env-inserted tokens."""
    old_logprobs_BT: torch.Tensor
    """Generator's logprobs of the targets under the mask (the PPO ratio's denominator)."""
    advantages_B: torch.Tensor
    """Group-normalized advantage of each row's completion."""

    def rows(self, lo: int, hi: int) -> PackedBatch:
        """Rows lo..hi-1 as their own batch (views, no copy)."""
        return PackedBatch(*(t[lo:hi] for t in (self.input_ids_BT, self.targets_BT, self.loss_mask_BT,
                                                self.old_logprobs_BT, self.advantages_B)))


@dataclass
class GradStats:
    """What one forward/backward pass over a (mini)batch measured."""

    loss_sum: float
    """Sum of the per-token clipped-surrogate loss over the masked tokens."""
    tokens: float
    """Masked (trained) tokens in the batch; the token-mean's denominator (clamped to >= 1)."""
    clipped_tokens: float
    """Tokens whose ratio was clipped."""
    abs_logprob_diff_sum: float
    """Sum over masked tokens of |trainer logprob - generator logprob|."""
    max_abs_logprob_diff: float
    """Max over masked tokens of |trainer logprob - generator logprob|."""


def pack(groups: list[Group], pad_id: int, scale_by_std: bool = True) -> PackedBatch:
    """Builds next-token targets over completions only; prompt and padding are masked out."""
    rows, advantages = [], []
    for group in groups:
        adv = group_advantages(torch.tensor(group.rewards, dtype=torch.float32), scale_by_std=scale_by_std)
        for sample, a in zip(group.samples, adv.tolist(), strict=True):
            rows.append(sample)
            advantages.append(a)
    T = max(len(s.prompt_ids) + len(s.completion_ids) for s in rows) - 1
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    old = torch.zeros(B, T)
    for i, s in enumerate(rows):
        seq = s.prompt_ids + s.completion_ids
        n, p = len(seq) - 1, len(s.prompt_ids)
        input_ids[i, :n] = torch.tensor(seq[:-1])
        targets[i, :n] = torch.tensor(seq[1:])
        c = len(s.completion_ids)
        # Environment-inserted tokens (loss_mask 0) are context, never trained on.
        mask[i, p - 1 : p - 1 + c] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, p - 1 : p - 1 + c] = torch.tensor(s.gen_logprobs, dtype=torch.float32)
    return PackedBatch(input_ids, targets, mask, old, torch.tensor(advantages, dtype=torch.float32))


def minibatch_row_ranges(group_sizes: list[int], minibatches: int) -> list[tuple[int, int]]:
    """Row ranges of `minibatches` contiguous parts of whole groups, group counts differing by <= 1.

    With fewer groups than `minibatches`, each group is its own part (never an empty minibatch).
    """
    n = len(group_sizes)
    parts = min(minibatches, n)
    bounds, row, g = [], 0, 0
    for k in range(parts):
        take = n // parts + (1 if k < n % parts else 0)
        start = row
        row += sum(group_sizes[g : g + take])
        g += take
        bounds.append((start, row))
    return bounds


class GRPOTrainer:
    """Owns the policy, optimizer and lr schedule; `step` consumes groups and returns metrics.

    `model_config.checkpoint` is an HF checkpoint directory or a training checkpoint written by
    `save_state` (then the policy is rebuilt from it; call `load_state` for the rest).
    """

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, temperature: float, seed: int) -> None:
        torch.manual_seed(seed)
        torch.set_num_threads(train_config.threads)
        self.cfg = train_config
        self.temperature = temperature
        self.dtype = getattr(torch, model_config.dtype)
        if ckpt_io.is_training_checkpoint(model_config.checkpoint):
            model, self.model_config = ckpt_io.load_policy(model_config.checkpoint)
            self.model = model.to(self.dtype)
            self.tokenizer_dir = str(Path(model_config.checkpoint) / ckpt_io.HF_CONFIG_DIR)
        else:
            self.model, self.model_config = load_model(model_config.checkpoint, dtype=self.dtype)
            self.tokenizer_dir = model_config.checkpoint
        self.model.train()
        self.pad_id = self.model_config.eos_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=train_config.lr,
            betas=train_config.betas,
            weight_decay=train_config.weight_decay,
        )
        self.scheduler = build_scheduler(self.optimizer, train_config)
        self.version: PolicyVersion = 0
        self.skipped_steps = 0
        """`step` calls whose every optimizer step was skipped (non-finite loss or grad norm)."""
        self.consecutive_skipped = 0
        """Skipped `step` calls since the last call that updated the policy."""

    # ------------------------------------------------------------------------- gradients

    def accumulate_gradients(self, batch: PackedBatch) -> GradStats:
        """Leaves in `.grad` the gradient of the batch's token-mean loss; no optimizer step.

        Forward/backward runs in micro-batches of `micro_batch_size` rows; each backward is
        divided by the whole batch's token count, so the sum is the token-mean's gradient.
        """
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = batch.loss_mask_BT.sum().clamp(min=1.0)
        loss_total = clipped = diff_sum = diff_max = 0.0
        mb = self.cfg.micro_batch_size
        for lo in range(0, batch.input_ids_BT.shape[0], mb):
            sl = slice(lo, lo + mb)
            mask = batch.loss_mask_BT[sl]
            # Trim trailing padding of this micro-batch: less compute, same result.
            T = int(mask.nonzero()[:, 1].max()) + 1 if mask.any() else 1
            logits = self.model(batch.input_ids_BT[sl, :T])
            logprobs = token_logprobs(logits, batch.targets_BT[sl, :T], self.temperature)
            loss_sum, stats = clipped_surrogate_loss(
                logprobs, batch.old_logprobs_BT[sl, :T], batch.advantages_B[sl], mask[:, :T],
                self.cfg.clip_eps, self.cfg.clip_eps_high,
            )
            (loss_sum / total_tokens).backward()
            loss_total += loss_sum.item()
            clipped += stats["clipped_tokens"].item()
            diff_sum += stats["abs_logprob_diff_sum"].item()
            d = stats["max_abs_logprob_diff"].item()
            diff_max = d if math.isnan(d) or d > diff_max else diff_max  # a NaN must show, not vanish
        return GradStats(loss_total, total_tokens.item(), clipped, diff_sum, diff_max)

    def _optimizer_step(self, stats: GradStats) -> tuple[float, float, bool]:
        """Clips and applies the accumulated gradient; skips it when loss or norm is non-finite.

        Returns (token-mean loss, pre-clip grad norm, taken). Gradients are freed either way.
        """
        loss = stats.loss_sum / stats.tokens
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm_t = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        norm = norm_t.item()
        taken = math.isfinite(loss) and math.isfinite(norm)
        if taken:
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.cfg.grad_clip, norm_t)
            self.optimizer.step()
            self.scheduler.step()
        # A skipped step leaves no trace: no optimizer/scheduler step, and no gradient survives.
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm, taken

    # ------------------------------------------------------------------------- step

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One policy update (version + 1) from rollout groups; returns its metrics.

        Advantages come once per group; the old logprobs of the PPO ratio are the generator's.
        The call makes `ppo_epochs` passes; each splits the groups into `minibatches` contiguous
        parts of whole groups and takes one optimizer step per part (token-mean over its tokens).
        An optimizer step whose loss or gradient norm is not finite is skipped; if all are, the
        call is a skipped step: the version stays and `train/skipped` is 1.

        Metrics:
          loss, grad_norm: mean over the call's optimizer steps taken of the minibatch token-mean
            loss and of the pre-clip gradient norm; in a skipped call, mean over the skipped ones
            (non-finite, which is why they were skipped).
          lr: learning rate of the call's last optimizer step (the one it would have used, if skipped).
          train/clip_fraction: clipped / tokens over every forward of the call (all passes).
          train/mismatch_mean_abs, train/mismatch_max_abs: |trainer - generator| logprob on the
            first minibatch of the first pass, the only forward at the generator's weights.
          train/tokens: trained tokens in the groups; train/advantage_nonzero_frac.
          train/optimizer_steps, train/skipped_optimizer_steps: taken / skipped in this call.
          train/skipped: 1.0 when the call was skipped; train/skipped_steps: skipped calls so far;
          train/consecutive_skipped: skipped calls since the last update; policy_version: after it.
        """
        if not groups:
            raise ValueError("GRPOTrainer.step needs at least one group")
        start = time.perf_counter()
        batch = pack(groups, self.pad_id, self.cfg.scale_advantages_by_std)
        ranges = minibatch_row_ranges([len(g.samples) for g in groups], self.cfg.minibatches)
        taken_loss, taken_norm, skipped_loss, skipped_norm = [], [], [], []
        clipped = seen_tokens = 0.0
        first: GradStats | None = None
        lr = self.scheduler.get_last_lr()[0]
        for _ in range(self.cfg.ppo_epochs):
            for lo, hi in ranges:
                lr = self.scheduler.get_last_lr()[0]
                stats = self.accumulate_gradients(batch.rows(lo, hi))
                if first is None:
                    first = stats
                clipped += stats.clipped_tokens
                seen_tokens += stats.tokens
                loss, norm, taken = self._optimizer_step(stats)
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
        return {
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(norms) / len(norms),
            "lr": lr,
            "train/clip_fraction": clipped / seen_tokens,
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
        }

    # ------------------------------------------------------------------------- weights out

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """HF-named float tensors for rollout workers (tied head omitted, as in HF files)."""
        return {k: v.clone() for k, v in hf_state_dict(self.model).items()}

    def get_version(self) -> PolicyVersion:
        return self.version

    def save(self, out_dir: str) -> str:
        """Exports the current policy as an HF checkpoint directory (tokenizer included)."""
        return str(save_checkpoint(self.model, out_dir, tokenizer_dir=self.tokenizer_dir))

    # ------------------------------------------------------------------------- full state

    def save_state(self, dir: str) -> None:
        """Writes everything an exact resume needs into `dir` (layout: titanrl.trainer.checkpoint)."""
        out = Path(dir)
        out.mkdir(parents=True, exist_ok=True)
        # get_state_dict initialises an empty optimizer state with a zero-lr step (and skips that
        # if gradients exist): start from no gradients, and undo the initialisation afterwards
        # so that saving never changes how training continues.
        self.optimizer.zero_grad(set_to_none=True)
        stepped = bool(self.optimizer.state)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        ckpt_io.dcp_save({"model": model_sd, "optim": optim_sd}, out / ckpt_io.MODEL_OPTIM_DIR)
        if not stepped:
            self.optimizer.state.clear()
        ckpt_io.write_hf_config(out / ckpt_io.HF_CONFIG_DIR, self.model_config, self.dtype, self.tokenizer_dir)
        torch.save(
            {
                "format_version": ckpt_io.FORMAT_VERSION,
                "version": self.version,
                "skipped_steps": self.skipped_steps,
                "consecutive_skipped": self.consecutive_skipped,
                "optimizer_stepped": stepped,
                "scheduler": self.scheduler.state_dict(),
                "rng": ckpt_io.rng_state(),
            },
            out / ckpt_io.TRAINER_STATE_FILE,
        )

    def load_state(self, dir: str) -> int:
        """Restores a `save_state` directory (weights, optimizer, schedule, counters, RNG); returns the version."""
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
        self.optimizer.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        loaded = {"model": model_sd, "optim": optim_sd}
        ckpt_io.dcp_load(loaded, ckpt / ckpt_io.MODEL_OPTIM_DIR)
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        if not state["optimizer_stepped"]:
            self.optimizer.state.clear()  # saved before any optimizer step: AdamW starts fresh
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skipped = state["consecutive_skipped"]
        ckpt_io.set_rng_state(state["rng"])
        return self.version
