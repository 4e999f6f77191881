"""Tied embedding / LM head across pipeline stages (the Megatron way).

With `tie_word_embeddings=True` one matrix is both the first stage's token embedding and the
last stage's LM head, and those stages run on different pipeline ranks. Each of the two ranks
keeps its own copy (the embedding on pp rank 0, the head on pp rank pp-1, the latter in the
last stage even when schedules interleave; names from the spec's StateDictAdapter), both loaded from the same
tensor. After every backward the two copies' gradients are summed over a two-rank group, one
group per (dp, cp, tp) coordinate, so each copy holds the full tied gradient; with identical
gradients, clipping and optimizer state the copies stay bitwise equal.

Under FSDP the copies' gradients are DTensors sharded the same way (one `fully_shard` of the
same shape over the same data-parallel mesh coordinates), so summing their local shards is
summing the full gradients. Under TP both copies are vocabulary shards (Shard(0)) of the same
rows at the same tp coordinate, so the same holds.
The global gradient norm and checkpoints count the tied matrix once, under the embedding's name
(see step.grad_norm and checkpoint.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanrl.models.architectures import spec_for



def split_tied(pp: int, tie_word_embeddings: bool) -> bool:
    """Whether the tied matrix is split into a first-stage and a last-stage copy."""
    return pp > 1 and tie_word_embeddings


def tied_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group {pp rank 0, pp rank pp-1} at this rank's other mesh coordinates, or None for a
    rank in a middle stage. Collective: every rank creates every group, in the same order."""
    pp_dim = mesh.mesh_dim_names.index("pp")
    ranks = mesh.mesh.movedim(pp_dim, 0)
    first, last = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    me = dist.get_rank()
    mine = None
    for pair in zip(first, last, strict=True):
        group = dist.new_group(list(pair))
        if me in pair:
            mine = group
    return mine


def tied_copy(part: nn.Module) -> nn.Parameter | None:
    """The tied matrix's copy held by pipeline stage `part`: its embedding (first stage), its
    LM head (last stage), or None (middle stages)."""
    if getattr(part, "is_first", False):
        return part.input_embedding().weight
    if getattr(part, "is_last", False):
        return part.output_head().weight
    return None


def is_head_copy(part: nn.Module, name: str) -> bool:
    """Whether `name` in `part` is the last stage's duplicate of the tied matrix."""
    return getattr(part, "is_last", False) and name == spec_for(part.config).state_dict_adapter.head


@torch.no_grad()
def sum_tied_grads(parts: list[nn.Module], group: dist.ProcessGroup) -> None:
    """Sums the tied copies' gradients over `group` in place: both end up with the full gradient.

    A copy without a gradient (no micro-batch reached it) contributes zeros.
    """
    copies = [p for p in map(tied_copy, parts) if p is not None]
    if len(copies) != 1:
        raise RuntimeError(f"a rank of the tied-embedding group holds {len(copies)} tied copies, expected 1")
    (param,) = copies
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad  # no_grad: the shard itself
    if not local.numel():  # both copies are sharded alike: an empty shard is empty on both ranks
        return
    buf = local if local.is_contiguous() else local.contiguous()  # gloo wants contiguous buffers
    dist.all_reduce(buf, group=group)
    if buf is not local:
        local.copy_(buf)


@torch.no_grad()
def tied_copies_equal(parts: list[nn.Module], group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether, in every {first, last} pipeline-rank pair, the two copies of the tied matrix hold
    bitwise-equal values (shard by shard). Collective over the world: call on every rank."""
    equal = True
    if group is not None:
        copies = [p for p in map(tied_copy, parts) if p is not None]
        local = copies[0].to_local() if isinstance(copies[0], DTensor) else copies[0].detach()
        if local.numel():
            both = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(both, local.contiguous(), group=group)
            equal = torch.equal(both[0], both[1])
    unequal = torch.tensor([0.0 if equal else 1.0], device=device)
    dist.all_reduce(unequal)
    return unequal.item() == 0
