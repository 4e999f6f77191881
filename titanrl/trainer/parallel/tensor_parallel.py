"""Tensor parallel (Megatron-style) with optional sequence parallel, on one decoder-layer stack.

Per layer: q/k/v and gate/up are column-parallel (each rank holds whole heads / MLP columns),
o and down are row-parallel (their outputs are summed across ranks). The per-head q/k norms see
head-sharded inputs, so their weights are replicated DTensors whose gradients DTensor sums over
the TP ranks. Embedding, final norm and LM head stay replicated plain modules: every TP rank
computes them identically, and their gradients agree without communication.

With sequence parallel the residual stream between TP regions is split along the sequence:
layer norms run on 1/tp of the tokens, row-parallel outputs are reduce-scattered instead of
all-reduced, and the stack all-gathers before each attention / MLP and once at its end.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tensor_parallel(layers: Sequence[nn.Module], tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shards each decoder layer of `layers` (in order) over `tp_mesh`, in place.

    `layers` is a contiguous stack (all of a model's layers, or one pipeline stage's): with
    sequence parallel its first layer scatters the sequence and its last gathers it back, so
    the stack's input and output stay full, replicated [B, T, D] tensors.
    """
    between = Shard(1) if sequence_parallel else Replicate()
    for layer in layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            # Inputs are [B, T, heads/tp, head_dim]: sharded on dim 2. SequenceParallel is the
            # style that replicates a norm's weight over a sharded input dimension.
            "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan.update(
                {
                    "input_layernorm": SequenceParallel(use_local_output=True),
                    "post_attention_layernorm": SequenceParallel(use_local_output=True),
                    # All-gather the sequence before each TP region (cos/sin arrive full).
                    "self_attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None, None),
                        desired_input_layouts=(Replicate(), None, None),
                        use_local_output=True,
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                    ),
                }
            )
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel and layers:
        parallelize_module(
            layers[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            ),
        )
        parallelize_module(
            layers[-1],
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
        )
