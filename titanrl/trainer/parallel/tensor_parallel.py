"""Tensor parallel (Megatron-style) with optional sequence parallel, on one decoder-layer stack.

Per layer: q/k/v and gate/up are column-parallel (each rank holds whole heads / MLP columns),
o and down are row-parallel (their outputs are summed across ranks). The per-head q/k norms see
head-sharded inputs, so their weights are replicated DTensors whose gradients DTensor sums over
the TP ranks. The token embedding and the LM head are vocabulary-parallel
(`apply_vocab_parallel`): each rank holds 1/tp of the vocabulary's rows, and a tied pair shares
the one sharded matrix; the final norm stays a replicated plain module.

With sequence parallel the residual stream between TP regions is split along the sequence:
layer norms run on 1/tp of the tokens, row-parallel outputs are reduce-scattered instead of
all-reduced, and the stack all-gathers before each attention / MLP and once at its end.

A mixture-of-experts layer's `mlp` (SparseMoeBlock: router and stacked experts) is not split
by tp. Without expert parallelism it is replicated over the tp ranks, which all run it on the
same (gathered) tokens; under sequence parallel its output is cut back to this rank's part of the
sequence. With ep == tp (experts_over_tp) the block runs on this rank's sequence-parallel
tokens and sends them to the experts' ranks (expert_parallel.py).

A LoRA-adapted linear (`LoraLinear`) is split with its adapters by the same column / row plan
(lora_tp.py); parameters frozen before (the base weights) stay frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from titanrl.models.common.parallelize import TensorParallelPlan
from titanrl.trainer.parallel.lora_tp import lora_aware


def apply_tensor_parallel(layers: Sequence[nn.Module], tp_mesh: DeviceMesh, plan: TensorParallelPlan,
                          sequence_parallel: bool, experts_over_tp: bool = False) -> None:
    """Shards each decoder layer of `layers` (in order) over `tp_mesh` with the family's `plan`
    (its spec's `parallel_plan.tensor_parallel`), in place.

    `layers` is a contiguous stack (all of a model's layers, or one pipeline stage's): with
    sequence parallel its first layer scatters the sequence and its last gathers it back, so
    the stack's input and output stay full, replicated [B, T, D] tensors. experts_over_tp: the
    sparse layers' experts are split over these ranks (ep == tp, sequence parallel), see above.
    """
    between = Shard(1) if sequence_parallel else Replicate()
    for layer in layers:
        frozen = {name for name, p in layer.named_parameters() if not p.requires_grad}
        parallelize_module(layer, tp_mesh, lora_aware(layer, plan(layer, between, sequence_parallel, experts_over_tp)))
        # Some styles (SequenceParallel's replicated norm weights) make every parameter trainable
        # again: a frozen one (the base under LoRA) stays frozen.
        for name, p in layer.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
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


def apply_vocab_parallel(part: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shards the token embedding and the LM head held by `part` over the vocabulary on `tp_mesh`.

    The embedding is torch's vocabulary-parallel embedding (RowwiseParallel of an nn.Embedding:
    each rank looks up the ids it owns, zeros elsewhere, and the output is all-reduced to a
    replicated [B, T, D]). The head's weight becomes a DTensor sharded on rows (Shard(0)); the
    step's chunked logprobs consume it shard by shard (chunked_logprobs.py), so no rank computes
    full-vocabulary logits. A tied head is re-pointed at the sharded embedding matrix. A vocabulary
    that tp does not divide is split unevenly, as Shard(0) does (the last rank holds fewer rows).
    """
    embed = part.input_embedding()
    head = part.output_head()
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if head is None:
        return
    if tied:
        head.weight = embed.weight
    else:
        w = head.weight
        head.weight = nn.Parameter(distribute_tensor(w.detach(), tp_mesh, [Shard(0)]), requires_grad=w.requires_grad)
