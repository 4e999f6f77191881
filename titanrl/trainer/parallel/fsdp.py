"""FSDP2 (`fully_shard`) over dp_shard (x cp), HSDP when dp_replicate > 1; expert weights over
their own mesh under expert parallelism."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard



def mixed_precision_policy(compute_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Compute in `compute_dtype` (None: the parameters' dtype), reduce gradients in float32.

    Only when the compute dtype is narrower than the parameters: otherwise FSDP2's default (no
    casts, gradients reduced in the parameters' dtype), so float32 and all-bf16 runs are unchanged.
    """
    if compute_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def apply_fsdp(part: nn.Module, layers: Sequence[nn.Module], dp_mesh: DeviceMesh,
               compute_dtype: torch.dtype | None = None, expert_mesh: DeviceMesh | None = None,
               sparse_blocks: Sequence[nn.Module] = ()) -> None:
    """Shards each decoder layer, then the rest of `part` (embedding, norm, head), over `dp_mesh`.

    One FSDP unit per layer lets a layer's all-gather overlap the previous layer's compute.
    Gradients are summed, not averaged, over the data-parallel ranks: the GRPO step already
    divides every rank's loss by the whole batch's token count, so the sum is the token-mean's
    gradient (and context-parallel ranks, which share this mesh, must be summed too).
    compute_dtype: mixed precision (see mixed_precision_policy); the sharded parameters, their
    gradients and the optimizer state keep the parameters' dtype.
    expert_mesh: under expert parallelism, the mesh that shards each sparse layer's ep-split
    experts (their own FSDP unit, over the ranks holding the same experts: mesh.expert_meshes).
    """
    mp_policy = mixed_precision_policy(compute_dtype)
    if expert_mesh is not None:
        for block in sparse_blocks:  # the family's sparse blocks (ParallelPlan.sparse_blocks)
            fully_shard(block.expert_module(), mesh=expert_mesh, mp_policy=mp_policy)
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy)
    fully_shard(part, mesh=dp_mesh, mp_policy=mp_policy)
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: a divide factor otherwise becomes PREMUL_SUM, which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)
