"""The parallel plan of the shared decoder: how tensor parallelism shards a block, which parts of a
block stay eager under torch.compile, which submodule is the attention core, and how XLA's SPMD
shards each weight. Generic parallel code (`titanrl.trainer.parallel`) applies a `ParallelPlan`
from the model's spec and never names a module itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

TensorParallelPlan = Callable[[nn.Module, Placement, bool, bool], dict[str, ParallelStyle]]
"""plan(layer, between, sequence_parallel, experts_over_tp) -> {submodule path: style} for one block."""


def decoder_tp_plan(layer: nn.Module, between: Placement, sequence_parallel: bool, experts_over_tp: bool = False,
                    sparse: bool = False) -> dict[str, ParallelStyle]:
    """One decoder block's tensor-parallel plan (Megatron-style column/row pairs).

    between: the placement of the residual stream between blocks (Shard(1) with sequence parallel).
    sparse: the block's feed-forward is a mixture of experts, sharded by its own plan (expert
    parallelism) or replicated; experts_over_tp: its experts are split over these ranks.
    """
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
    }
    if getattr(layer.self_attn, "q_norm", None) is not None:
        # Inputs are [B, T, heads/tp, head_dim]: sharded on dim 2. SequenceParallel is the
        # style that replicates a norm's weight over a sharded input dimension.
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sparse:
        plan.update({
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        })
    if sequence_parallel:
        plan.update({
            "input_layernorm": SequenceParallel(use_local_output=True),
            "post_attention_layernorm": SequenceParallel(use_local_output=True),
            # All-gather the sequence before each TP region (cos/sin arrive full).
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
        })
        if not sparse:
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        elif not experts_over_tp:
            # A replicated block: gather the sequence, run it on every rank, keep this rank's part.
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
            )
    return plan


def no_sparse_blocks(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """A dense family's sparse blocks: none."""
    return []


@dataclass(frozen=True)
class ParallelPlan:
    """How generic parallel code treats a family's blocks."""

    tensor_parallel: TensorParallelPlan = decoder_tp_plan
    """One block's TP/SP plan."""
    attention_core: str = "self_attn.backend"
    """The submodule of a block that computes attention from q/k/v (swapped for ring attention under
    context parallelism; polled by the trainer's idle-core switch)."""
    eager_parts: tuple[str, ...] = ("self_attn.backend",)
    """Submodules of a block (where it has them) that run eagerly inside the compiled block."""
    xla_column_parallel: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head",
                                            "embed_tokens")
    """Modules whose weights [out, in] split their output rows over tp under XLA SPMD (the vocabulary,
    for the embedding and head)."""
    xla_row_parallel: tuple[str, ...] = ("o_proj", "down_proj")
    """Modules whose weights [out, in] split their input columns over tp under XLA SPMD."""
    sparse_blocks: Callable[[Sequence[nn.Module]], list[nn.Module]] = no_sparse_blocks
    """The mixture-of-experts blocks among some decoder layers (expert parallelism shards their
    `expert_module()` on dim 0, FSDP wraps it on the expert mesh); none for a dense family."""

    def xla_weight_axes(self, name: str) -> str:
        """'column', 'row' or 'fsdp' for a 2-D parameter named `name` (module name before `.weight`)."""
        module = name.rsplit(".", 2)[-2] if name.count(".") else name
        if module in self.xla_row_parallel:
            return "row"
        if module in self.xla_column_parallel:
            return "column"
        return "fsdp"


DECODER_PLAN = ParallelPlan()
"""The plan of every dense family built on the shared decoder."""
