"""Qwen3-MoE's parallel plan: the shared decoder's, with sparse blocks' experts left to expert
parallelism (or replicated) by tensor parallelism and kept eager under torch.compile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn
from torch.distributed.tensor import Placement
from torch.distributed.tensor.parallel import ParallelStyle

from titanrl.models.common.parallelize import DECODER_PLAN, decoder_tp_plan
from titanrl.models.qwen3.moe import SparseMoeBlock


def moe_tp_plan(layer: nn.Module, between: Placement, sequence_parallel: bool,
                experts_over_tp: bool = False) -> dict[str, ParallelStyle]:
    """The decoder's TP plan, told whether this block's feed-forward is a sparse MoE block."""
    return decoder_tp_plan(layer, between, sequence_parallel, experts_over_tp,
                           sparse=isinstance(layer.mlp, SparseMoeBlock))


def sparse_moe_blocks(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The `SparseMoeBlock` feed-forwards among `layers` (dense layers have none)."""
    return [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]


MOE_PLAN = replace(DECODER_PLAN, tensor_parallel=moe_tp_plan, sparse_blocks=sparse_moe_blocks,
                   # the experts' per-expert token counts are data, and their grouped matmul has no
                   # float32 meta kernel for the compiler to trace
                   eager_parts=(*DECODER_PLAN.eager_parts, "mlp.experts"))
