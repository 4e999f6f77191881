"""Expert parallelism: each sparse layer's experts split over the ep ranks, tokens sent to them.

The stacked expert weights `[E, out, in]` become DTensors sharded on dim 0 over the ep mesh
(`mesh.expert_meshes`): ep rank r holds experts r*E/ep .. (r+1)*E/ep - 1, and FSDP2 then shards
each slice over the ranks that hold the same experts. The router stays replicated: every rank
routes its own tokens. `ExpertParallelDispatch` replaces the block's local expert call:

1. dispatch: the expert-sorted token copies are contiguous by owning rank; the per-expert counts
   go round first (an all-to-all of E integers), then the tokens (`all_to_all_single` with
   uneven splits: its list form has no gloo kernel);
2. the received copies, grouped by (source rank, local expert), are regrouped by local expert
   and run through this rank's experts;
3. combine: the outputs go back in the order they came (the inverse regrouping, the reverse
   all-to-all), and the block un-sorts and weighs them as without ep.

The functional all-to-all's backward is the reverse all-to-all, so gradients reach the
tokens' ranks and each expert's gradient sums every rank's tokens. When the ep ranks are the
tp ranks, each holds its sequence-parallel shard of the tokens, so the router's gradient is
summed over tp after the backward (`sum_router_grads`) as FSDP sums it over data parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard



class ExpertParallelDispatch:
    """`SparseMoeBlock.dispatch` over an ep group: (x_sorted [M, D], counts [E]) -> y_sorted [M, D]."""

    def __init__(self, local_experts: nn.Module, group: dist.ProcessGroup, num_experts: int) -> None:
        self.run_local, self.group = local_experts, group
        self.ep = dist.get_world_size(group)
        self.local_experts = num_experts // self.ep

    def __call__(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.local_experts
        # received[s, j]: copies rank s sends to this rank's local expert j.
        received = torch.empty_like(counts_E)
        dist.all_to_all_single(received, counts_E, group=self.group)
        received = received.view(ep, local)
        send_splits = counts_E.view(ep, local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        x_recv = all_to_all_single_autograd(x_MD, recv_splits, send_splits, self.group)
        # Regroup by local expert (stable: each expert's copies keep their source-rank order).
        expert_of = torch.repeat_interleave(torch.arange(local, device=x_MD.device).repeat(ep), received.flatten())
        order = torch.argsort(expert_of, stable=True)
        y_local = self.run_local(x_recv[order], received.sum(0))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(y_local[inverse], send_splits, recv_splits, self.group)


def apply_expert_parallel(blocks: Sequence[nn.Module], ep_mesh: DeviceMesh, tokens_split_over_tp: bool) -> None:
    """Shards every sparse layer's experts over `ep_mesh` (Shard(0)) and installs the all-to-all
    dispatch, in place; the model may be on the meta device (no data moves: every rank holds
    the same full model, and keeps its own rows).

    tokens_split_over_tp: the ep ranks are the tp ranks, each routing its sequence-parallel
    shard of the tokens: the routers' gradients must then be summed over them (sum_router_grads).
    """
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    group = ep_mesh.get_group()
    for block in blocks:
        if block.num_experts % ep:
            raise ValueError(f"{block.num_experts} experts cannot be split over ep={ep} ranks")
        experts = block.expert_module()
        for name, p in list(experts.named_parameters(recurse=False)):  # stacked [E, ...] each
            rows = p.shape[0] // ep
            local = p.detach()[rank * rows:(rank + 1) * rows].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                         stride=p.stride())
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        block.dispatch = ExpertParallelDispatch(experts, group, block.num_experts)
        block.set_router_grad_group(group if tokens_split_over_tp else None)


def sum_router_grads(parts: Sequence[nn.Module]) -> None:
    """Sums the router gradients over tp where the tp ranks routed different tokens (tp = ep);
    call once after the backward, before any norm or step. Nothing to do in other layouts."""
    for part in parts:
        for module in part.modules():
            group = getattr(module, "grad_sum_group", None)
            if group is not None and module.weight.grad is not None:  # a router summed over tp
                g = module.weight.grad
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)
