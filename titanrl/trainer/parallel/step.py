"""The GRPO gradient step under any parallel layout, equal to the single-process step.

Every rank receives the same whole `PackedBatch`. Each data-parallel rank takes an equal,
contiguous share of its rows (zero-mask rows pad the batch to a multiple of the dp degree);
TP ranks share rows and compute identically; CP ranks share rows and take sequence chunks;
pipeline ranks share rows and run their stages. Every rank divides its loss sum by the token
count of the *whole* batch, and FSDP sums (not averages) gradients, so the gradient is the
token-mean's over the batch, as in `GRPOTrainer.accumulate_gradients`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from titanrl import kernels
from titanrl.config import TrainConfig
from titanrl.trainer.grpo import clipped_surrogate_loss, token_logprobs
from titanrl.trainer.parallel.mesh import coord, dp_rank_and_size, owns
from titanrl.trainer.parallel.parallelize import ParallelModel
from titanrl.trainer.parallel.pipeline import build_schedule
from titanrl.trainer.parallel.tied import sum_tied_grads
from titanrl.trainer.parallel.validate import check_batch_invariant, sequence_multiple
from titanrl.trainer.trainer import GradStats, LogprobParity, PackedBatch


def _map_batch(batch: PackedBatch, per_token, per_row) -> PackedBatch:
    """Applies per_token to the [B, T] fields and per_row to the [B] fields."""
    return PackedBatch(**{
        f.name: (per_token if getattr(batch, f.name).dim() == 2 else per_row)(getattr(batch, f.name))
        for f in dataclasses.fields(batch)
    })


def _pad_rows(batch: PackedBatch, rows: int) -> PackedBatch:
    """`batch` with all-zero rows appended up to `rows`: their loss mask is 0, so they add nothing."""
    extra = rows - batch.input_ids_BT.shape[0]
    if extra <= 0:
        return batch
    pad = lambda t: torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])  # noqa: E731
    return _map_batch(batch, pad, pad)


def _fit_length(batch: PackedBatch, T: int) -> PackedBatch:
    """Trims or right-pads (with zeros, mask 0) the time dimension to T; causal attention keeps
    the real tokens' results unchanged."""
    cur = batch.input_ids_BT.shape[1]
    if T <= cur:
        return _map_batch(batch, lambda t: t[:, :T], lambda t: t)
    return _map_batch(batch, lambda t: torch.cat([t, t.new_zeros((t.shape[0], T - cur))], 1), lambda t: t)


def _trimmed_len(mask_BT: torch.Tensor, multiple: int) -> int:
    """Length up to the last trained token (as the single-process step trims), rounded up to `multiple`."""
    T = int(mask_BT.nonzero()[:, 1].max()) + 1 if mask_BT.any() else 1
    return -(-T // multiple) * multiple


class _Totals:
    """Per-rank sums of what GradStats reports, reduced over the world at the end."""

    def __init__(self) -> None:
        self.loss = self.clipped = self.diff_sum = 0.0
        self.diff_max = float("-inf")
        self.nan = 0.0
        self.parity = LogprobParity()

    def add(self, loss_sum: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        self.loss += loss_sum.item()
        self.clipped += stats["clipped_tokens"].item()
        self.diff_sum += stats["abs_logprob_diff_sum"].item()
        d = stats["max_abs_logprob_diff"].item()
        if math.isnan(d):
            self.nan += 1
        else:
            self.diff_max = max(self.diff_max, d)


class ParallelGRPOStep:
    """GRPO gradient accumulation and optimizer step over a ParallelModel (call on every rank).

    batch_invariant: run the model and the logprobs through `titanrl.kernels` (as
    `GRPOTrainer(batch_invariant=True)` does), so each token's logprob has the same bits as in
    one process. Data parallel and pipeline layouts (dp_replicate / dp_shard / pp) only change
    which rows share a kernel call, so they keep those bits; tp and cp are refused
    (validate.check_batch_invariant says why).
    """

    def __init__(self, pm: ParallelModel, optimizers: list[torch.optim.Optimizer], train_config: TrainConfig,
                 temperature: float, batch_invariant: bool = False) -> None:
        self.pm, self.optimizers, self.cfg, self.temperature = pm, optimizers, train_config, temperature
        self.seq_multiple = sequence_multiple(pm.parallel)
        if batch_invariant:
            check_batch_invariant(pm.parallel)
            for part in pm.parts:  # the whole model, or pipeline stages (their LM head included)
                part.set_batch_invariant(True)
        # The pipelined step's loss_fn uses this too, on the last stage's logits.
        self.token_logprobs = kernels.token_logprobs if batch_invariant else token_logprobs

    # ------------------------------------------------------------------------- gradients

    def accumulate_gradients(self, batch: PackedBatch) -> GradStats:
        """Leaves in `.grad` the gradient of the whole batch's token-mean loss; returns global stats.

        Same contract and numbers as GRPOTrainer.accumulate_gradients: micro-batches of
        `micro_batch_size` rows (per data-parallel rank), each backward divided by the whole
        batch's token count.
        """
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        totals, total_tokens = self._forward(batch, backward=True)
        self._reduce_partial_grads()
        if self.pm.tied_group is not None:
            # Before any norm or step: both copies of a split tied matrix need its full gradient.
            sum_tied_grads(self.pm.parts, self.pm.tied_group)
        return self._global_stats(totals, total_tokens)

    @torch.no_grad()
    def measure_parity(self, batch: PackedBatch) -> LogprobParity:
        """The parity `accumulate_gradients(batch)` would report, from a forward pass only.

        Same row split, micro-batches, trimming and cross-rank reduction as the gradient pass
        (pipelines run their schedule's forward-only `eval`), so the numbers are the same bits;
        no gradient is computed or touched and no optimizer state changes.
        """
        totals, total_tokens = self._forward(batch, backward=False)
        return self._global_stats(totals, total_tokens).parity

    def _forward(self, batch: PackedBatch, backward: bool) -> tuple[_Totals, torch.Tensor]:
        """Runs this rank's share of the batch (with backward, or forward only): its totals and
        the whole batch's token count."""
        total_tokens = batch.loss_mask_BT.sum().clamp(min=1.0)
        dp_rank, dp_size = dp_rank_and_size(self.pm.mesh)
        per_rank = -(-batch.input_ids_BT.shape[0] // dp_size)
        local = _pad_rows(batch, per_rank * dp_size).rows(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        totals = _Totals()
        if self.pm.pipelined:
            self._pipelined(local, total_tokens, totals, backward)
        else:
            self._micro_batches(local, total_tokens, totals, backward)
        return totals, total_tokens

    def _loss(self, logits, targets, old, adv, mask, current, totals: _Totals) -> torch.Tensor:
        """Summed clipped-surrogate loss of one micro-batch; records its stats in `totals`."""
        logprobs = self.token_logprobs(logits, targets, self.temperature)
        loss_sum, stats = clipped_surrogate_loss(logprobs, old, adv, mask, self.cfg.clip_eps, self.cfg.clip_eps_high)
        totals.add(loss_sum.detach(), stats)
        totals.parity.add(logprobs, old, mask * current[:, None])
        return loss_sum

    def _device_tensors(self, sub: PackedBatch) -> list[torch.Tensor]:
        """ids, targets, mask, old logprobs (sequence-sharded under CP), advantages, current flags."""
        ctx, dev = self.pm.context, self.pm.device
        per_token = [t.to(dev) for t in (sub.input_ids_BT, sub.targets_BT, sub.loss_mask_BT, sub.old_logprobs_BT)]
        if ctx:
            per_token = [ctx.shard(t, dim=1) for t in per_token]
        return [*per_token, sub.advantages_B.to(dev), sub.current_B.to(dev)]

    def _micro_batches(self, local: PackedBatch, total_tokens: torch.Tensor, totals: _Totals, backward: bool) -> None:
        (model,) = self.pm.parts
        mb = self.cfg.micro_batch_size
        starts = list(range(0, local.input_ids_BT.shape[0], mb))
        for i, lo in enumerate(starts):
            sub = local.rows(lo, lo + mb)
            sub = _fit_length(sub, _trimmed_len(sub.loss_mask_BT, self.seq_multiple))
            ids, targets, mask, old, adv, current = self._device_tensors(sub)
            positions = None
            if self.pm.context:
                positions = self.pm.context.positions(ids.shape[1], ids.device).expand_as(ids)
            if backward and isinstance(model, FSDPModule):
                # Reduce-scatter gradients once, after the last micro-batch.
                model.set_requires_gradient_sync(i == len(starts) - 1)
            loss_sum = self._loss(model(ids, positions), targets, old, adv, mask, current.float(), totals)
            if backward:
                (loss_sum / total_tokens).backward()

    def _pipelined(self, local: PackedBatch, total_tokens: torch.Tensor, totals: _Totals, backward: bool) -> None:
        pm = self.pm
        rows = local.input_ids_BT.shape[0]
        n_micro = max(-(-rows // self.cfg.micro_batch_size), pm.parallel.pp)
        n_micro = -(-n_micro // pm.parallel.pp) * pm.parallel.pp  # interleaving wants a multiple of pp
        local = _pad_rows(local, -(-rows // n_micro) * n_micro)
        # Every micro-batch of a pipeline runs at one shape: the longest trained length.
        local = _fit_length(local, _trimmed_len(local.loss_mask_BT, self.seq_multiple))
        ids, targets, mask, old, adv, current = self._device_tensors(local)
        # The schedule splits one target tensor into micro-batches: pack what the loss needs.
        per_row = lambda t: t[:, None].double().expand_as(mask)  # noqa: E731
        packed = torch.stack([targets.double(), mask.double(), old.double(), per_row(adv), per_row(current)], -1)
        calls: list[_Totals] = []

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            t, m, o, a, c = target.unbind(-1)
            if not self.pm.context:
                # Trim this micro-batch's trailing padding as the single-process step does: the
                # loss sums the same [rows, T] tensor, so with batch-invariant logprobs and the
                # same rows per micro-batch it has the same bits (zero-mask columns add no gradient).
                T = _trimmed_len(m, 1)
                logits, t, m, o = logits[:, :T], t[:, :T], m[:, :T], o[:, :T]
            calls.append(_Totals())
            loss_sum = self._loss(logits, t.long(), o.float(), a[:, 0].float(), m.float(), c[:, 0].float(), calls[-1])
            return loss_sum / total_tokens

        schedule = build_schedule(pm.parts, pm.parallel, pm.mesh, pm.device, n_micro, loss_fn)
        has_first = any(p.is_first for p in pm.parts)
        has_last = any(p.is_last for p in pm.parts)
        args = (ids,) if has_first else ()
        # eval: the same schedule with its backward actions skipped (loss_fn still runs).
        run = schedule.step if backward else schedule.eval
        run(*args, target=packed if has_last else None, return_outputs=False)
        if has_last:
            # The schedule may also call loss_fn while inferring shapes, before the real
            # micro-batches: the last n_micro calls are the ones that ran the batch.
            if len(calls) < n_micro:
                raise RuntimeError(f"pipeline schedule computed {len(calls)} losses for {n_micro} micro-batches")
            for c in calls[-n_micro:]:
                totals.loss += c.loss
                totals.clipped += c.clipped
                totals.diff_sum += c.diff_sum
                totals.diff_max = max(totals.diff_max, c.diff_max)
                totals.nan += c.nan
                _merge_parity(totals.parity, c.parity)

    def _reduce_partial_grads(self) -> None:
        """Gradients left Partial (replicated weights over sharded activations) are summed now."""
        for p in self.pm.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])

    def _global_stats(self, totals: _Totals, total_tokens: torch.Tensor) -> GradStats:
        """Sums each rank's disjoint share: TP ranks (identical) and non-last pipeline ranks count nothing."""
        pm = self.pm
        counts = coord(pm.mesh, "tp") == 0 and (not pm.pipelined or any(p.is_last for p in pm.parts))
        par = totals.parity
        mine = [totals.loss, totals.clipped, totals.diff_sum, totals.nan,
                par.diff_sum, par.different, par.checked, float(math.isnan(par.diff_max))]
        sums = torch.tensor(mine if counts else [0.0] * len(mine), dtype=torch.float64, device=pm.device)
        dist.all_reduce(sums)
        tops = [totals.diff_max, par.diff_max if par.checked else float("-inf")]
        top = torch.tensor([t if counts and not math.isnan(t) else float("-inf") for t in tops],
                           dtype=torch.float64, device=pm.device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        loss, clipped, diff_sum, nan, p_sum, p_diff, p_checked, p_nan = sums.tolist()
        diff_max, p_max = top.tolist()
        parity = LogprobParity(p_sum, float("nan") if p_nan else max(p_max, 0.0), p_diff, p_checked)
        return GradStats(loss, total_tokens.item(), clipped, diff_sum, float("nan") if nan else diff_max, parity)

    # ------------------------------------------------------------------------- optimizer

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradient (each element counted once across the world;
        a tied matrix split across pipeline stages once, as the single-process model's one parameter)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.pm.device)
        for p in self.pm.parameters(head_copy=False):
            g = p.grad
            if g is None or not owns(self.pm.mesh, g):
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            sq += local.double().pow(2).sum()
        dist.all_reduce(sq)
        return math.sqrt(sq.item())

    def clip_and_step(self, stats: GradStats) -> tuple[float, float, bool]:
        """GRPOTrainer._optimizer_step across ranks: (token-mean loss, pre-clip norm, taken).

        Clips to `grad_clip` and steps every optimizer unless loss or norm is non-finite;
        gradients are freed either way. The lr schedule is the caller's.
        """
        loss = stats.loss_sum / stats.tokens
        norm = self.grad_norm()
        taken = math.isfinite(loss) and math.isfinite(norm)
        if taken:
            if self.cfg.grad_clip > 0:
                coef = min(self.cfg.grad_clip / (norm + 1e-6), 1.0)
                if coef < 1.0:
                    for p in self.pm.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
            for opt in self.optimizers:
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return loss, norm, taken


def _merge_parity(into: LogprobParity, other: LogprobParity) -> None:
    into.diff_sum += other.diff_sum
    into.different += other.different
    into.checked += other.checked
    if other.checked:
        into.diff_max = other.diff_max if math.isnan(other.diff_max) or other.diff_max > into.diff_max \
            else into.diff_max
