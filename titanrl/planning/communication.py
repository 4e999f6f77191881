"""Bytes one rank sends per optimizer step under a layout: the planner's measure of communication.

Ring collectives: an all-gather or reduce-scatter of S bytes over n ranks sends S (n - 1) / n
per rank, an all-reduce twice that. The terms, per step:

- fsdp: FSDP2 all-gathers every unit of the stage before forward and again before backward
  (parameters are resharded after forward), once per micro-batch, in the compute dtype, and
  reduce-scatters the float32 gradients once per step (over dp_shard x cp; experts over
  dp_shard x cp x tp / ep). HSDP adds an all-reduce of the gradient shards over dp_replicate.
- tp: with sequence parallel, each block all-gathers and reduce-scatters its [tokens, hidden]
  activations around attention and the dense MLP (forward), and again in backward; the
  vocabulary-parallel head adds a log-sum-exp all-reduce (2 floats per token).
- cp: ring attention passes every K and V chunk once around the ring in forward, and K, V and
  their gradients in backward.
- pp: each micro-batch's [tokens, hidden] activation is sent to the next stage and its gradient
  back.
- ep: each sparse layer sends every routed token copy to its expert and back (dispatch and
  combine), in forward and in backward.

The totals ignore overlap (FSDP's prefetch hides much of its traffic behind compute; TP's
cannot be hidden) and link speeds: they rank layouts, they do not predict time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titanrl.planning.memory import DTYPE_BYTES, Layout, Workload, schedule, stage_layers, stage_params
from titanrl.planning.shape import ModelShape


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends per optimizer step, by kind (the busiest pipeline stage)."""

    fsdp: int
    tp: int
    cp: int
    pp: int
    ep: int
    bubble: float
    """Pipeline bubble: the fraction of a step a stage idles, (pp - 1) / (micro-batches + pp - 1)."""

    @property
    def total(self) -> int:
        return self.fsdp + self.tp + self.cp + self.pp + self.ep

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _ring(nbytes: int, n: int) -> int:
    return nbytes * (n - 1) // n if n > 1 else 0


def communication(shape: ModelShape, layout: Layout, work: Workload) -> Communication:
    b = DTYPE_BYTES[work.compute_dtype]
    sched = schedule(layout, work)
    T, n_micro, h = sched.tokens_per_micro_batch, sched.micro_batches, shape.hidden_size
    kv = shape.num_key_value_heads * shape.head_dim
    worst = None
    for stage in range(layout.pp):
        p = stage_params(shape, layout, stage)
        dense = -(-p.tp_split // layout.tp) + p.replicated  # one tp rank's unsharded non-expert parameters
        experts = p.expert_elements // layout.ep
        fsdp = n_micro * 2 * (_ring(dense * b, layout.fsdp_size) + _ring(experts * b, layout.expert_fsdp_size))
        fsdp += _ring(dense * 4, layout.fsdp_size) + _ring(experts * 4, layout.expert_fsdp_size)
        if layout.dp_replicate > 1:
            shard = dense // layout.fsdp_size + experts // layout.expert_fsdp_size
            fsdp += 2 * _ring(shard * 4, layout.dp_replicate)
        layers = stage_layers(shape, layout, stage)
        sparse = sum(shape.is_sparse_layer(i) for i in layers)
        tp = 0
        if layout.tp > 1:
            # 2 collectives per TP region (gather in, scatter out), forward and backward;
            # attention is a region in every layer, the MLP in dense layers.
            regions = 2 * len(layers) - sparse
            tp = n_micro * regions * 4 * _ring(T * h * b, layout.tp)
            if stage == layout.pp - 1:
                tp += n_micro * 2 * _ring(2 * T * 4, layout.tp) * 2  # log-sum-exp and target logit, fwd + bwd
        cp = 0
        if layout.cp > 1:
            chunk = T * 2 * kv // layout.tp * b  # this rank's K and V
            cp = n_micro * len(layers) * 3 * chunk * (layout.cp - 1)
        pp = 0
        if layout.pp > 1:
            sends = (stage > 0) + (stage < layout.pp - 1)  # gradient back, activation forward
            pp = n_micro * sends * T * h * b
        ep = 0
        if layout.ep > 1:
            copies = T // (layout.tp if layout.sequence_parallel else 1) * shape.num_experts_per_tok
            ep = n_micro * sparse * 4 * _ring(copies * h * b, layout.ep)
        c = (fsdp, tp, cp, pp, ep)
        if worst is None or sum(c) > sum(worst):
            worst = c
    bubble = (layout.pp - 1) / (n_micro + layout.pp - 1)
    return Communication(*worst, bubble=bubble)
