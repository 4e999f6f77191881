"""The GRPO trainer: recompute logprobs, advantages, clipped surrogate, AdamW step.

Plain Python class; the driver runs it as a Ray actor (`ray.remote(GRPOTrainer)`),
and unit tests use it in-process.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from titanrl.config import ModelConfig, TrainConfig
from titanrl.models.hf_checkpoint import hf_state_dict, load_model, save_checkpoint
from titanrl.trainer.lr_schedule import lr_multiplier
from titanrl.trainer.grpo import clipped_surrogate_loss, group_advantages, token_logprobs
from titanrl.types import Group, PolicyVersion


@dataclass
class PackedBatch:
    """Right-padded token batch; position t of `targets` is predicted from `input_ids[:, :t+1]`."""

    input_ids_BT: torch.Tensor
    targets_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor


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


class GRPOTrainer:
    """Owns the policy and optimizer; `step` consumes groups and returns metrics."""

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, temperature: float, seed: int) -> None:
        torch.manual_seed(seed)
        torch.set_num_threads(train_config.threads)
        self.cfg = train_config
        self.temperature = temperature
        dtype = getattr(torch, model_config.dtype)
        self.checkpoint_dir = model_config.checkpoint
        self.model, self.model_config = load_model(model_config.checkpoint, dtype=dtype)
        self.model.train()
        self.pad_id = self.model_config.eos_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=train_config.lr,
            betas=train_config.betas,
            weight_decay=train_config.weight_decay,
        )
        tc = train_config
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, tc.steps, tc.warmup_steps, tc.lr_decay, tc.min_lr_ratio)
        )
        self.version: PolicyVersion = 0

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step over all groups (micro-batched); returns per-step metrics."""
        start = time.perf_counter()
        batch = pack(groups, self.pad_id, self.cfg.scale_advantages_by_std)
        total_tokens = batch.loss_mask_BT.sum().clamp(min=1.0)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = clipped = diff_sum = 0.0
        diff_max = 0.0
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
            diff_max = max(diff_max, stats["max_abs_logprob_diff"].item())
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.version += 1
        n_tok = total_tokens.item()
        return {
            "loss": loss_total / n_tok,
            "grad_norm": grad_norm,
            "lr": lr,
            "train/clip_fraction": clipped / n_tok,
            # Trainer-vs-generator logprob gap at the generator's weights version: the
            # train/inference mismatch plus any staleness.
            "train/mismatch_mean_abs": diff_sum / n_tok,
            "train/mismatch_max_abs": diff_max,
            "train/tokens": n_tok,
            "train/advantage_nonzero_frac": (batch.advantages_B != 0).float().mean().item(),
            "time/train_s": time.perf_counter() - start,
        }

    def state_dict_for_push(self) -> dict[str, torch.Tensor]:
        """HF-named float tensors for rollout workers (tied head omitted, as in HF files)."""
        return {k: v.clone() for k, v in hf_state_dict(self.model).items()}

    def get_version(self) -> PolicyVersion:
        return self.version

    def save(self, out_dir: str) -> str:
        """Exports the current policy as an HF checkpoint directory (tokenizer included)."""
        return str(save_checkpoint(self.model, out_dir, tokenizer_dir=self.checkpoint_dir))
