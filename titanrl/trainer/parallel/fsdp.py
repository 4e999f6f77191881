"""FSDP2 (`fully_shard`) over dp_shard (x cp), HSDP when dp_replicate > 1."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def apply_fsdp(part: nn.Module, layers: Sequence[nn.Module], dp_mesh: DeviceMesh) -> None:
    """Shards each decoder layer, then the rest of `part` (embedding, norm, head), over `dp_mesh`.

    One FSDP unit per layer lets a layer's all-gather overlap the previous layer's compute.
    Gradients are summed, not averaged, over the data-parallel ranks: the GRPO step already
    divides every rank's loss by the whole batch's token count, so the sum is the token-mean's
    gradient (and context-parallel ranks, which share this mesh, must be summed too).
    """
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(part, mesh=dp_mesh)
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: a divide factor otherwise becomes PREMUL_SUM, which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)
