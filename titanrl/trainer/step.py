"""The GRPO gradient step under any layout: the one implementation, a single process included.

Every rank receives the same whole `PackedBatch`. Each data-parallel rank takes an equal,
contiguous share of its rows (zero-mask rows pad the batch to a multiple of the dp degree);
TP ranks share rows and compute identically; CP ranks share rows and take sequence chunks;
pipeline ranks share rows and run their stages. Every rank divides its loss sum by the token
count of the *whole* batch, and FSDP sums (not averages) gradients, so the gradient is the
token-mean's over the batch whatever the layout. Other aggregations (train.loss.aggregation)
weigh each row by a constant computed from the whole batch before the split
(titanrl/trainer/losses/aggregation.py), and sums over a whole sequence (GSPO's ratio, sequence
corrections) are all-reduced over the cp ranks that hold its chunks, so they too are the same
under every layout. A single process is the layout whose mesh is None: one data-parallel rank
holding every row, and no collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from titanrl import kernels
from titanrl.config.schema import TrainConfig
from titanrl.config.unplanned import concrete_train
from titanrl.trainer.batch import PackedBatch
from titanrl.trainer.chunked_logprobs import chunked_token_logprobs
from titanrl.models.packed_sequences import packed_attention_layout
from titanrl.trainer.logprob_chunks import chunk_tokens_for
from titanrl.trainer.moe import (
    MicroBatchRouting,
    MoeStats,
    MoeTotals,
    completion_inputs,
    moe_settings,
    real_tokens,
    update_expert_bias,
)
from titanrl.trainer.grpo import token_logprobs
from titanrl.trainer.losses.aggregation import batch_sequences, row_weights
from titanrl.trainer.losses.measures import LossMeasures
from titanrl.trainer.losses.off_policy import correction_weights
from titanrl.trainer.losses.policy import policy_loss
from titanrl.trainer.losses.settings import LossSettings, loss_settings
from titanrl.trainer.kl import kl_loss_sum
from titanrl.trainer.parallel.expert_parallel import sum_router_grads
from titanrl.trainer.packing import PackedMicroBatch, pack_micro_batch
from titanrl.trainer.parallel.mesh import all_reduce, coord, dp_rank_and_size, owns
from titanrl.trainer.parallel.parallelize import ParallelModel
from titanrl.trainer.parallel.pipeline import build_schedule
from titanrl.trainer.parallel.row_sum import row_sums
from titanrl.trainer.parallel.tied import sum_tied_grads
from titanrl.config.parallel import check_batch_invariant, sequence_multiple
from titanrl.trainer.stats import GradStats, LogprobParity, nan_max
from titanrl.trainer.truncation import Truncation
from titanrl.trainer.shape_buckets import length_bucket, row_bucket


def _pad_rows(batch: PackedBatch, rows: int) -> PackedBatch:
    """`batch` with all-zero rows appended up to `rows`: their loss mask is 0, so they add nothing."""
    extra = rows - batch.input_ids_BT.shape[0]
    if extra <= 0:
        return batch
    pad = lambda t: torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])  # noqa: E731
    return batch.map(pad, pad)


def _fit_length(batch: PackedBatch, T: int) -> PackedBatch:
    """Trims or right-pads (with zeros, mask 0) the time dimension to T; causal attention keeps
    the real tokens' results unchanged."""
    cur = batch.input_ids_BT.shape[1]
    if T <= cur:
        return batch.map(lambda t: t[:, :T], lambda t: t)
    return batch.map(lambda t: torch.cat([t, t.new_zeros((t.shape[0], T - cur, *t.shape[2:]))], 1), lambda t: t)


def trimmed_len(mask_BT: torch.Tensor, multiple: int = 1) -> int:
    """Length up to the last trained token (no compute over trailing padding), rounded up to `multiple`."""
    T = int(mask_BT.nonzero()[:, 1].max()) + 1 if mask_BT.any() else 1
    return -(-T // multiple) * multiple


NORM_CHUNK_ELEMENTS = 1 << 20
"""Elements of a gradient squared at once in float64 by `grad_norm` (8 MiB of float64)."""


def _squared_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of `t` in float64, a slice at a time: a whole-tensor float64 copy of a
    151,936-row embedding's gradient would be 1.2 GB on top of the optimizer's peak."""
    flat = t.detach().reshape(-1)
    sq = torch.zeros((), dtype=torch.float64, device=t.device)
    for lo in range(0, flat.numel(), NORM_CHUNK_ELEMENTS):
        chunk = flat[lo:lo + NORM_CHUNK_ELEMENTS].double()
        sq += torch.dot(chunk, chunk)
    return sq


class _Totals:
    """Per-rank sums of what GradStats reports, reduced over the world at the end.

    On a lazy device (XLA) reading a value would run the graph traced so far, so measurements
    are recorded and applied in `settle`, after the step's one program ran, on host copies.
    """

    def __init__(self, loss: LossSettings, xla: Any = None) -> None:
        self.loss = self.clipped = self.diff_sum = self.entropy = self.outside = 0.0
        self.diff_max = float("-inf")
        self.parity = LogprobParity()
        self.moe: MoeTotals | None = None
        self.measures = LossMeasures(loss)
        self.xla = xla
        self.loss_sums: list[torch.Tensor] = []
        """The micro-batches' loss sums as device tensors (the lazy step's finite check)."""
        self._recorded: list[tuple[Callable[..., None], tuple[Any, ...]]] = []

    def record(self, measure: Callable[..., None], *tensors: Any) -> None:
        """Calls `measure(*tensors)` now, or on a lazy device at `settle`."""
        if self.xla is None:
            measure(*tensors)
        else:
            self._recorded.append((measure, self.xla.own_buffers(tensors)))

    def settle(self) -> None:
        """Applies the recorded measurements: runs the traced program (a no-op once the step's
        sync ran it) and reads every recorded tensor back to the host once."""
        if not self._recorded:
            return
        self.xla.sync()
        recorded, self._recorded = self._recorded, []
        for measure, tensors in recorded:
            measure(*self.xla.to_host(tensors))

    def add(self, loss_sum: torch.Tensor, stats: dict[str, torch.Tensor], entropy_sum: torch.Tensor) -> None:
        self.loss_sums.append(loss_sum)
        self.record(self._add, loss_sum, stats, entropy_sum)

    def _add(self, loss_sum: torch.Tensor, stats: dict[str, torch.Tensor], entropy_sum: torch.Tensor) -> None:
        self.loss += loss_sum.item()
        self.entropy += entropy_sum.item()
        self.clipped += stats["clipped_tokens"].item()
        self.diff_sum += stats["abs_logprob_diff_sum"].item()
        self.diff_max = nan_max(self.diff_max, stats["max_abs_logprob_diff"].item())
        self.measures.add(stats)

    def add_outside(self, outside: torch.Tensor) -> None:
        self.outside += outside.item()

    def merge(self, other: _Totals) -> None:
        self.loss += other.loss
        self.entropy += other.entropy
        self.outside += other.outside
        self.clipped += other.clipped
        self.diff_sum += other.diff_sum
        self.diff_max = nan_max(self.diff_max, other.diff_max)
        self.parity.merge(other.parity)
        self.measures.merge(other.measures)


class _BatchScale(NamedTuple):
    """Totals of the whole (mini)batch that every micro-batch's loss is normalised by."""

    tokens: torch.Tensor
    """Trained tokens (clamped to >= 1): each backward divides its loss sum by it."""
    sequences: torch.Tensor
    """Rows holding a trained token (the seq-mean aggregations' S)."""


class GRPOStep:
    """GRPO gradient accumulation and optimizer step over a ParallelModel (call on every rank).

    batch_invariant: run the model and the logprobs through `titanrl.kernels`, so they match a
    batch-invariant generator bit for bit. Data parallel and pipeline layouts (dp_replicate /
    dp_shard / pp) only change which rows share a kernel call, so they keep those bits; tp and
    cp are refused (validate.check_batch_invariant says why).

    The LM head runs in `chunked_token_logprobs` (train.memory.logprob_chunk_tokens tokens at a time,
    with its own backward): the model returns final-norm hidden states and no rank ever holds a
    micro-batch's full [rows, T, V] logits.

    truncation: the generator's top-k / top-p (rollout.sampling.logprobs='sampled'); logprobs and entropy
    are then those of the truncated, renormalised distribution it sampled from.
    """

    def __init__(self, pm: ParallelModel, optimizers: list[torch.optim.Optimizer], train_config: TrainConfig,
                 temperature: float, batch_invariant: bool = False, truncation: Truncation | None = None,
                 xla: Any = None) -> None:
        self.pm, self.optimizers, self.temperature = pm, optimizers, temperature
        self.cfg = concrete_train(train_config)  # 'auto' memory settings a driver did not plan
        self.xla = xla
        """The XLA runtime (titanrl.trainer.xla.runtime.XlaRuntime) when the model is on XLA:
        batches run at bucketed shapes, sharded over its SPMD mesh, and nothing is read back
        inside a step. None on CPU and CUDA."""
        self.truncation = truncation if truncation is not None and truncation.active else None
        self._outside_BT: torch.Tensor | None = None
        """The last head call's targets outside the truncated kept set (read by `_count_outside`)."""
        self.seq_multiple = sequence_multiple(pm.parallel)
        # train.compute.pack_sequences: pipelines run fixed-shape micro-batches, ring attention has no packed
        # layout, and XLA compiles one program per padded shape bucket.
        self.packing = train_config.compute.pack_sequences and xla is None and not pm.pipelined and not pm.context
        self.share_prompts = self.packing and train_config.compute.share_prompts
        if batch_invariant:
            check_batch_invariant(pm.parallel)
        for part in pm.parts:  # the whole model, or pipeline stages (their LM head included)
            part.set_batch_invariant(batch_invariant)
        self.batch_invariant = batch_invariant
        # Mixture of experts (None: dense): replay, auxiliary loss, routing metrics, expert bias.
        # Pipelined trainers, and sequence-parallel ones (a router may see a tp rank's share of the
        # tokens), run none of these: config validation refuses replay and balancing there.
        self.moe = moe_settings(train_config, pm.config)
        split_tokens = pm.parallel.tp > 1 and pm.parallel.sequence_parallel
        if self.moe is not None and (pm.pipelined or split_tokens):
            if self.moe.replay:
                raise NotImplementedError(
                    "train.moe.router_replay is not implemented with pp > 1 or sequence parallelism"
                )
            self.moe = None
        # The unchunked reference of what `_head` computes (for callers that hold logits).
        self.token_logprobs = kernels.token_logprobs if batch_invariant else token_logprobs
        self.loss = loss_settings(train_config)
        if self.loss.sequence_level and pm.pipelined and pm.context:
            raise NotImplementedError("sequence-level losses and corrections (train.loss.objective='gspo', train."
                                      "off_policy_correction='*_sequence'/'mis_geometric') with pp > 1 and cp > 1")
        # A sequence's sum spans its chunks on every cp rank.
        self.cp_group = pm.mesh["cp"].get_group() if pm.context else None

    # ------------------------------------------------------------------------- gradients

    def accumulate_gradients(self, batch: PackedBatch) -> GradStats:
        """Leaves in `.grad` the gradient of the whole batch's loss (the train.loss.aggregation
        average, token-mean by default); returns global stats.

        Forward/backward runs in micro-batches of `micro_batch_size` rows (per data-parallel
        rank); each backward is divided by the whole batch's token count, so the sum is the
        token-mean's gradient. With `train.off_policy.decoupled_loss`, `batch.proximal_BT` holds the
        logprobs before this step's first update (None: this forward is at those weights).
        """
        totals, scale = self._gradients(batch)
        return self._global_stats(totals, scale.tokens)

    def _gradients(self, batch: PackedBatch) -> tuple[_Totals, _BatchScale]:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        totals, scale = self._forward(batch, backward=True)
        self._reduce_partial_grads()
        sum_router_grads(self.pm.parts)  # ep == tp: each tp rank routed its own tokens
        if self.pm.tied_group is not None:
            # Before any norm or step: both copies of a split tied matrix need its full gradient.
            sum_tied_grads(self.pm.parts, self.pm.tied_group)
        return totals, scale

    def accumulate_and_step(self, batch: PackedBatch) -> tuple[GradStats, float, float, bool]:
        """`accumulate_gradients` then `clip_and_step`: (stats, loss, pre-clip norm, taken).

        On XLA the same computation is traced without reading anything back, so forward, loss,
        backward, clip and AdamW update compile into one program per shape bucket: the clip
        coefficient is a tensor (a factor of 1 leaves a gradient's bits), and the update lands
        only where loss and norm are finite (`XlaRuntime.masked_step`), decided on the device.
        """
        if self.xla is None:
            stats = self.accumulate_gradients(batch)
            return (stats, *self.clip_and_step(stats))
        if self.moe is not None:
            raise NotImplementedError("mixture-of-experts policies do not train on XLA")
        totals, scale = self._gradients(batch)
        sq = self._grad_squared_sum()
        norm_t = sq.sqrt()
        loss_t = torch.stack(totals.loss_sums).sum() / scale.tokens.to(norm_t.device)
        finite = torch.isfinite(loss_t) & torch.isfinite(norm_t)
        if self.cfg.optimizer.grad_clip > 0:
            coef = (self.cfg.optimizer.grad_clip / (norm_t + 1e-6)).clamp(max=1.0)
            for p in self.pm.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        undo = self.xla.masked_step(self.optimizers, finite)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        stats = self._global_stats(totals, scale.tokens)  # runs the program
        loss, norm = stats.loss_sum / stats.tokens, math.sqrt(sq.item())
        taken = math.isfinite(loss) and math.isfinite(norm)
        if not taken:
            undo()
        return stats, loss, norm, taken

    @torch.no_grad()
    def measure_parity(self, batch: PackedBatch) -> LogprobParity:
        """The parity `accumulate_gradients(batch)` would report, from a forward pass only.

        Same row split, micro-batches, trimming and cross-rank reduction as the gradient pass
        (pipelines run their schedule's forward-only `eval`), so the numbers are the same bits;
        no gradient is computed or touched and no optimizer state changes.
        """
        totals, scale = self._forward(batch, backward=False)
        return self._global_stats(totals, scale.tokens).parity

    @torch.no_grad()
    @torch.no_grad()
    def batch_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """This model's logprobs of the trained target tokens, [B, T] on the batch's device (0 where
        the loss mask is), the same on every rank whatever the layout.

        The forward of the gradient pass (rows split over data-parallel ranks, micro-batches,
        trimming), without a backward; each rank writes its share (its rows; under CP its
        chunks' positions; tp ranks, identical, once) into a zero tensor, summed over the world:
        adding zeros, so the values are the computed bits. Not pipelined (its logprobs stay on
        the last stage).
        """
        if self.pm.pipelined:
            raise NotImplementedError("the pipelined trainer computes no per-token logprobs outside its loss")
        B, T = batch.targets_BT.shape
        first_row, local = self._local_rows(batch)
        # One shape on every rank, with room for the zero rows padding the last share and for
        # micro-batches padded to the sequence multiple; on XLA the local batch's bucketed shape.
        width = -(-T // self.seq_multiple) * self.seq_multiple
        shape = local.targets_BT.shape if self.xla is not None else (B + local.targets_BT.shape[0], width)
        out = torch.zeros(shape, device=self.pm.device)
        counts = coord(self.pm.mesh, "tp") == 0
        for lo, sub, logprobs, _, _ in self._logprobs_by_micro_batch(local, backward=False):
            rows = slice(first_row + lo, first_row + lo + sub.input_ids_BT.shape[0])
            cols = (self.pm.context.positions(logprobs.shape[1], out.device) if self.pm.context
                    else slice(0, logprobs.shape[1]))
            if counts:  # untrained positions 0: which ones a micro-batch computes depends on the layout
                out[rows, cols] = torch.where(sub.loss_mask_BT > 0, logprobs.float(), 0.0)
        all_reduce(out, self.pm.mesh)
        return out.to(batch.old_logprobs_BT.device)[:B, :T]

    def _local_rows(self, batch: PackedBatch) -> tuple[int, PackedBatch]:
        """This data-parallel rank's equal, contiguous share of the rows (zero-mask rows pad the
        batch to a multiple of the dp degree) and the index of its first row."""
        if self.xla is not None:
            # One program per bucket: every micro-batch at the bucket's length (SPMD splits rows).
            rows, _ = row_bucket(batch.input_ids_BT.shape[0], self.cfg.memory.micro_batch_size)
            T = length_bucket(trimmed_len(batch.loss_mask_BT), self.seq_multiple)
            return 0, _fit_length(_pad_rows(batch, rows), T)
        dp_rank, dp_size = dp_rank_and_size(self.pm.mesh)
        per_rank = -(-batch.input_ids_BT.shape[0] // dp_size)
        return dp_rank * per_rank, _pad_rows(batch, per_rank * dp_size).rows(dp_rank * per_rank,
                                                                              (dp_rank + 1) * per_rank)

    def _forward(self, batch: PackedBatch, backward: bool) -> tuple[_Totals, _BatchScale]:
        """Runs this rank's share of the batch (with backward, or forward only): its totals and
        the whole batch's token and sequence counts."""
        total_tokens = batch.loss_mask_BT.sum().clamp(min=1.0)
        # Whole-row token counts, before rows split over ranks and cp chunks (the loss's normalisers).
        batch = dataclasses.replace(batch, row_tokens_B=batch.loss_mask_BT.sum(1))
        scale = _BatchScale(total_tokens, batch_sequences(batch.row_tokens_B))
        _, local = self._local_rows(batch)
        totals = _Totals(self.loss, self.xla)
        if self.moe is not None:
            totals.moe = MoeTotals(len(self.moe.sparse_layers), self.moe.num_experts, self.pm.device)
        if self.pm.pipelined:
            self._pipelined(local, scale, totals, backward)
        else:
            # The auxiliary loss weighs each micro-batch by its share of the whole batch's real tokens.
            real_total = real_tokens(batch.loss_mask_BT).sum().clamp(min=1)
            for _, sub, logprobs, entropy, aux in self._logprobs_by_micro_batch(local, backward, totals.moe,
                                                                                 real_total):
                loss_sum = self._loss(logprobs, entropy, sub, totals, scale)
                self._count_outside(sub.loss_mask_BT, totals)
                if backward:
                    loss = loss_sum / total_tokens.to(loss_sum.device)
                    if aux is not None and self.moe.aux_loss_coef:
                        loss = loss + self.moe.aux_loss_coef * aux.to(loss.device)
                    loss.backward()
        return totals, scale

    def _head(self, targets_BT: torch.Tensor, mask_BT: torch.Tensor | None = None,
              packed: PackedMicroBatch | None = None):  # noqa: ANN202 (a models.qwen3.LMHead)
        """The LM head for one micro-batch: (final-norm hidden, head weight [V, D]) -> (logprobs
        [B, T], entropy [B, T]) of `targets_BT`, computed chunk by chunk.

        With `mask_BT`, only the trained targets (mask > 0) reach the head, and the other slots
        are 0: no logits are computed that the loss does not weigh. `packed`: the hidden states
        are the packed row [1, N, D] of that micro-batch's real tokens, not [B, T, D].
        """

        def head(hidden_BTD: torch.Tensor, weight_VD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if isinstance(weight_VD, DTensor) and weight_VD.device_mesh.mesh_dim_names != ("tp",):
                # Only the tp shards may remain: an FSDP-sharded head here would mean the head
                # runs outside the FSDP unit's forward, where its weight is not gathered.
                raise RuntimeError(f"the LM head weight reached the logprob head sharded over "
                                   f"{weight_VD.device_mesh.mesh_dim_names}, expected whole or tp-sharded")
            B, T = targets_BT.shape
            D = hidden_BTD.shape[-1]
            # A vocabulary-parallel head's rows are split over tp: size chunks by this rank's share.
            vocab_rows = -(-weight_VD.shape[0] // self.pm.parallel.tp)
            hidden_ND = hidden_BTD.reshape(-1, D)
            source = None  # the hidden row of each slot (rows, cols); None: the slots' own order
            if packed is not None:  # every real slot, from its packed token (a shared prompt's for several)
                rows, cols, source = packed.slot_rows_S, packed.slot_cols_S, packed.slot_token_S
            elif mask_BT is not None:
                rows, cols = (i.reshape(-1) for i in torch.meshgrid(
                    torch.arange(B, device=targets_BT.device), torch.arange(T, device=targets_BT.device),
                    indexing="ij"))
            if mask_BT is not None:
                trained = (mask_BT[rows, cols] > 0).nonzero()[:, 0]
                rows, cols = rows[trained], cols[trained]
                hidden_ND = hidden_ND[trained if source is None else source[trained]]
                targets_N = targets_BT[rows, cols]
            else:
                targets_N = targets_BT.reshape(B * T)
            outside_N = None
            if self.truncation is not None:
                outside_N = torch.zeros(targets_N.shape, dtype=torch.bool, device=hidden_BTD.device)
            logprobs, entropy = chunked_token_logprobs(
                hidden_ND, weight_VD, targets_N, self.temperature,
                chunk_tokens_for(vocab_rows, self.cfg.memory.logprob_chunk_tokens), self.batch_invariant,
                truncation=self.truncation, outside_N=outside_N)
            if mask_BT is None:
                if outside_N is not None:
                    self._outside_BT = outside_N.view(B, T)
                return logprobs.view(B, T), entropy.view(B, T)
            if outside_N is not None:
                self._outside_BT = outside_N.new_zeros(B, T).index_put((rows, cols), outside_N)
            scatter = lambda t: t.new_zeros(B, T).index_put((rows, cols), t)  # noqa: E731
            return scatter(logprobs), scatter(entropy)

        return head

    def _count_outside(self, mask_BT: torch.Tensor, totals: _Totals) -> None:
        """Adds the trained tokens of the last head call whose target was outside the trainer's
        truncated kept set (scored over kept + {target}; see chunked_logprobs)."""
        if self._outside_BT is not None:
            totals.record(totals.add_outside, (self._outside_BT.to(mask_BT.device) & (mask_BT > 0)).sum())
            self._outside_BT = None

    def _loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, sub: PackedBatch, totals: _Totals,
              scale: _BatchScale) -> torch.Tensor:
        """Summed loss of one micro-batch (its tensors on the device), weighted so that dividing
        by `scale.tokens` gives the train.loss.aggregation average; records its stats."""
        mask, old, adv, s = sub.loss_mask_BT, sub.old_logprobs_BT, sub.advantages_B, self.loss
        anchor, weights, stats = old, None, {}
        if s.at_proximal:
            # The ratio around the batch-start weights; the correction weighs pi_prox / pi_generator.
            anchor = logprobs.detach() if sub.proximal_BT is None else sub.proximal_BT
            weights, stats = correction_weights(s.correction, anchor, old, mask, s.cap, s.low, self._row_sum,
                                                sub.row_tokens_B)
        rows = row_weights(s.aggregation, sub.row_tokens_B, scale.tokens.to(mask.device),
                           scale.sequences.to(mask.device), s.length_norm)
        rows_B1 = None if rows is None else rows[:, None]
        if rows_B1 is not None:
            weights = rows_B1 if weights is None else weights * rows_B1
        loss_sum, policy_stats = policy_loss(s, logprobs, anchor, adv, mask, weights, self._row_sum, sub.row_tokens_B)
        stats.update(policy_stats)
        if s.entropy_coef:
            per_token = entropy * mask if rows_B1 is None else entropy * mask * rows_B1
            loss_sum = loss_sum - s.entropy_coef * per_token.sum()
        # train.kl.coef: KL to the reference (kl.py), a token-mean whatever the aggregation.
        loss_sum = loss_sum + kl_loss_sum(logprobs, sub, self.cfg)
        with torch.no_grad():  # the mismatch stats stay trainer vs generator
            gap = (logprobs - old).abs() * mask
            stats["abs_logprob_diff_sum"], stats["max_abs_logprob_diff"] = gap.sum(), gap.max()
        totals.add(loss_sum.detach(), stats, (entropy.detach() * mask).sum())
        totals.record(totals.parity.add, logprobs.detach(), old, mask * sub.current_B.float()[:, None])
        return loss_sum

    def _row_sum(self, x_BT: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B]: sums over each whole row, the other cp ranks' chunks included (with autograd)."""
        return row_sums(x_BT, self.cp_group)

    def _to_device(self, sub: PackedBatch) -> PackedBatch:
        """`sub` on this rank's device; its per-token fields sequence-sharded under CP."""
        return sub.map(self._per_token, lambda t: self._rows_to_device(t))

    def _rows_to_device(self, t_B: torch.Tensor) -> torch.Tensor:
        """A per-row tensor on this rank's device (on XLA split over the mesh's data-parallel axes)."""
        return t_B.to(self.pm.device) if self.xla is None else self.xla.place_rows(t_B)

    def _per_token(self, t_BT: torch.Tensor) -> torch.Tensor:
        """A per-token tensor [B, T, ...] of whole rows on this rank's device, sequence-sharded under CP."""
        t_BT = self._rows_to_device(t_BT)
        return self.pm.context.shard(t_BT, dim=1) if self.pm.context else t_BT

    def _logprobs_by_micro_batch(self, local: PackedBatch, backward: bool, moe: MoeTotals | None = None,
                                 real_total: torch.Tensor | None = None
                                 ) -> Iterator[tuple[int, PackedBatch, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """For each micro-batch of `local`: its first row, its tensors on the device (trimmed to
        its trained length), the model's logprobs of its targets and entropies [B, T], and (MoE)
        its weighted auxiliary loss, whose measurements go to `moe`. Router replay stays set
        until the consumer asks for the next micro-batch, i.e. through its backward."""
        (model,) = self.pm.parts
        mb = self.cfg.memory.micro_batch_size
        if self.xla is not None:  # a batch below one micro-batch is at its own row bucket
            mb = row_bucket(local.input_ids_BT.shape[0], mb)[1]
        starts = list(range(0, local.input_ids_BT.shape[0], mb))
        routing = MicroBatchRouting(model, self.moe) if self.moe is not None else None
        if moe is None and routing is not None:
            moe = MoeTotals(len(self.moe.sparse_layers), self.moe.num_experts, self.pm.device)
        real_total = local.loss_mask_BT.new_ones(()) if real_total is None else real_total
        for i, lo in enumerate(starts):
            whole = local.rows(lo, lo + mb)
            if self.xla is None:  # on XLA `local` is already at its bucket's length
                whole = _fit_length(whole, trimmed_len(whole.loss_mask_BT, self.seq_multiple))
            sub = self._to_device(whole)
            positions = None
            if self.pm.context:
                ids = sub.input_ids_BT
                positions = self.pm.context.positions(ids.shape[1], ids.device).expand_as(ids)
            if backward and isinstance(model, FSDPModule):
                # Reduce-scatter gradients once, after the last micro-batch.
                model.set_requires_gradient_sync(i == len(starts) - 1)
            packed = None
            if self.packing:  # shared prompts must also have been routed alike (router replay)
                packed = pack_micro_batch(sub.loss_mask_BT, self.seq_multiple,
                                          sub.input_ids_BT if self.share_prompts else None, sub.routed_experts_BTLK)
            ids = sub.input_ids_BT if packed is None else packed.gather(sub.input_ids_BT)
            if packed is not None:
                positions = packed.positions_1N
            # The head runs inside the model's forward: FSDP holds its weight unsharded there.
            # On XLA every slot is computed (a trained-token selection would be a dynamic shape).
            head = self._head(sub.targets_BT, None if self.xla is not None else sub.loss_mask_BT, packed)
            with contextlib.ExitStack() as layout:
                if packed is not None:  # open through the consumer's backward (recomputed attention)
                    layout.enter_context(packed_attention_layout(model, packed.layout))
                if routing is None:
                    logprobs, entropy = model(ids, positions, head=head)
                    yield lo, sub, logprobs, entropy, None
                    continue
                # Which tokens count, decided on whole rows (a CP rank holds chunks of them).
                real, completion = (self._per_token(m(whole.loss_mask_BT)) for m in (real_tokens, completion_inputs))
                routed = sub.routed_experts_BTLK
                if packed is not None:  # a shared prompt token counts once per row that holds it
                    real, completion = packed.slots_per_token(), packed.gather(completion)
                    routed = None if routed is None else packed.gather(routed)
                routing.begin(routed)
                try:
                    logprobs, entropy = model(ids, positions, head=head)
                    aux = routing.collect(real, completion, routed, real_total, moe)
                    yield lo, sub, logprobs, entropy, aux
                finally:
                    routing.end()

    def _pipelined(self, local: PackedBatch, scale: _BatchScale, totals: _Totals, backward: bool) -> None:
        pm = self.pm
        if local.proximal_BT is not None:
            raise NotImplementedError("the pipelined trainer has no decoupled loss (train.off_policy.decoupled_loss)")
        rows = local.input_ids_BT.shape[0]
        n_micro = max(-(-rows // self.cfg.memory.micro_batch_size), pm.parallel.pp)
        n_micro = -(-n_micro // pm.parallel.pp) * pm.parallel.pp  # interleaving wants a multiple of pp
        local = _pad_rows(local, -(-rows // n_micro) * n_micro)
        # Every micro-batch of a pipeline runs at one shape: the longest trained length.
        local = self._to_device(_fit_length(local, trimmed_len(local.loss_mask_BT, self.seq_multiple)))
        # The schedule splits one target tensor into micro-batches: pack what the loss needs.
        mask = local.loss_mask_BT
        per_row = lambda t: t[:, None].double().expand_as(mask)  # noqa: E731
        packed = torch.stack([local.targets_BT.double(), mask.double(), local.old_logprobs_BT.double(),
                              per_row(local.advantages_B), per_row(local.current_B), per_row(local.row_tokens_B)], -1)
        calls: list[_Totals] = []
        last = next((p for p in pm.parts if p.is_last), None)

        def loss_fn(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # The last stage returns final-norm hidden states; its LM head runs here, chunked.
            t, m, o, a, c, n = target.unbind(-1)
            if not self.pm.context:
                # Trim this micro-batch's trailing padding as the unpipelined step does: the
                # loss sums the same [rows, T] tensor, so with batch-invariant logprobs and the
                # same rows per micro-batch it has the same bits (zero-mask columns add no gradient).
                T = trimmed_len(m)
                hidden, t, m, o = hidden[:, :T], t[:, :T], m[:, :T], o[:, :T]
            calls.append(_Totals(self.loss))
            # The loss reads no input ids: the targets stand in for them.
            sub = PackedBatch(t.long(), t.long(), m.float(), o.float(), a[:, 0].float(), c[:, 0] > 0,
                              row_tokens_B=n[:, 0].float())
            # Through the stage module: FSDP gathers the head's weight, mixed precision casts it.
            logprobs, entropy = last(hidden, head=self._head(t.long()))
            loss_sum = self._loss(logprobs, entropy, sub, calls[-1], scale)
            self._count_outside(m, calls[-1])
            return loss_sum / scale.tokens.to(loss_sum.device)

        schedule = build_schedule(pm.parts, pm.parallel, pm.mesh, pm.device, n_micro, loss_fn)
        has_first = any(p.is_first for p in pm.parts)
        has_last = any(p.is_last for p in pm.parts)
        args = (local.input_ids_BT,) if has_first else ()
        # eval: the same schedule with its backward actions skipped (loss_fn still runs).
        run = schedule.step if backward else schedule.eval
        run(*args, target=packed if has_last else None, return_outputs=False)
        if has_last:
            # The schedule may also call loss_fn while inferring shapes, before the real
            # micro-batches: the last n_micro calls are the ones that ran the batch.
            if len(calls) < n_micro:
                raise RuntimeError(f"pipeline schedule computed {len(calls)} losses for {n_micro} micro-batches")
            for c in calls[-n_micro:]:
                totals.merge(c)

    def _reduce_partial_grads(self) -> None:
        """Gradients left Partial (replicated weights over sharded activations) are summed now, and
        a gradient laid out unlike its parameter takes the parameter's layout: the vocabulary-parallel
        embedding's backward (RowwiseParallel) returns a Replicate [V, D] gradient for a Shard(0)
        weight, which the tied-copy sum, the norm and the optimizer want as the parameter's shard."""
        for p in self.pm.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                g = p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
            if (isinstance(g, DTensor) and isinstance(p, DTensor) and g.device_mesh == p.device_mesh
                    and g.placements != p.placements):
                p.grad = g.redistribute(placements=p.placements)

    def _global_stats(self, totals: _Totals, total_tokens: torch.Tensor) -> GradStats:
        """Sums each rank's disjoint share: TP ranks (identical) and non-last pipeline ranks count nothing."""
        pm = self.pm
        totals.settle()
        counts = coord(pm.mesh, "tp") == 0 and (not pm.pipelined or any(p.is_last for p in pm.parts))
        par = totals.parity
        # A NaN max travels as a count (a max-reduction would drop it).
        mine = [totals.loss, totals.clipped, totals.diff_sum, float(math.isnan(totals.diff_max)),
                par.diff_sum, par.different, par.checked, float(math.isnan(par.diff_max)), totals.entropy,
                totals.outside]
        sums = torch.tensor(mine if counts else [0.0] * len(mine), dtype=torch.float64, device=pm.device)
        all_reduce(sums, pm.mesh)
        tops = [totals.diff_max, par.diff_max if par.checked else float("-inf")]
        top = torch.tensor([t if counts and not math.isnan(t) else float("-inf") for t in tops],
                           dtype=torch.float64, device=pm.device)
        all_reduce(top, pm.mesh, op=dist.ReduceOp.MAX)
        loss, clipped, diff_sum, nan, p_sum, p_diff, p_checked, p_nan, entropy, outside = sums.tolist()
        diff_max, p_max = top.tolist()
        parity = LogprobParity(p_sum, float("nan") if p_nan else max(p_max, 0.0), p_diff, p_checked)
        return GradStats(loss, total_tokens.item(), clipped, diff_sum, float("nan") if nan else diff_max, parity,
                         entropy, self._global_moe_stats(totals.moe, counts), outside,
                         self._global_loss_measures(totals.measures, counts))

    def _global_loss_measures(self, m: LossMeasures, counts: bool) -> dict[str, float]:
        """The loss's measures summed (maxima maxed) over the world; a NaN maximum stays NaN."""
        pm, out = self.pm, {}
        if m.sums:
            sums = torch.tensor([v if counts else 0.0 for v in m.sums.values()], dtype=torch.float64, device=pm.device)
            all_reduce(sums, pm.mesh)
            out.update(zip(m.sums, sums.tolist(), strict=True))
        if m.maxima:
            vals = [v if counts else float("-inf") for v in m.maxima.values()]
            top = torch.tensor([[float(math.isnan(v)), -math.inf if math.isnan(v) else v] for v in vals],
                               dtype=torch.float64, device=pm.device)
            all_reduce(top, pm.mesh, op=dist.ReduceOp.MAX)
            out.update((k, math.nan if nan else v) for k, (nan, v) in zip(m.maxima, top.tolist(), strict=True))
        return out

    def _global_moe_stats(self, moe: MoeTotals | None, counts: bool) -> MoeStats | None:
        """The routing measurements summed over the world (TP ranks, identical, count once)."""
        if moe is None:
            return None
        pm = self.pm
        aux = torch.tensor([moe.aux_loss], dtype=torch.float64, device=pm.device)
        scalars = torch.cat([moe.agreement.to(pm.device), aux]) * float(counts)
        load = moe.load.to(pm.device) * float(counts)
        all_reduce(scalars, pm.mesh)
        all_reduce(load, pm.mesh)
        agree, agree_used, compared, aux = scalars.tolist()
        nan = float("nan")
        return MoeStats(agree / compared if compared else nan, compared,
                        agree_used / compared if compared else nan, aux, load.cpu())

    # ------------------------------------------------------------------------- optimizer

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradient (each element counted once across the world;
        a tied matrix split across pipeline stages once, as the single-process model's one parameter)."""
        sq = self._grad_squared_sum()
        all_reduce(sq, self.pm.mesh)
        return math.sqrt(sq.item())

    def _grad_squared_sum(self) -> torch.Tensor:
        """This rank's share of the squared gradient norm, float64 on the device (not read back)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.pm.device)
        for p in self.pm.parameters(head_copy=False):
            g = p.grad
            if g is None or not owns(self.pm.mesh, g):
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            sq += _squared_sum(local)
        return sq

    def clip_and_step(self, stats: GradStats) -> tuple[float, float, bool]:
        """The finite check, clip and optimizer step: (token-mean loss, pre-clip norm, taken).

        Clips to `grad_clip` and steps every optimizer unless loss or norm is non-finite; a
        skipped step leaves no trace, and gradients are freed either way. The lr schedule is
        the caller's.
        """
        loss = stats.loss_sum / stats.tokens
        norm = self.grad_norm()
        taken = math.isfinite(loss) and math.isfinite(norm)
        if taken:
            if self.cfg.optimizer.grad_clip > 0:
                coef = min(self.cfg.optimizer.grad_clip / (norm + 1e-6), 1.0)
                if coef < 1.0:
                    for p in self.pm.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
            for opt in self.optimizers:
                opt.step()
            if self.moe is not None and self.moe.bias_update_rate is not None and stats.moe is not None:
                for part in self.pm.parts:
                    update_expert_bias(part, self.moe, stats.moe.load)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return loss, norm, taken
