"""Sums over whole rows when context parallel splits each row's tokens over ranks (with autograd).

A sequence-level loss term on one cp rank depends on every rank's chunk of that row; the
backward of a sum over the group is the sum over the group of each rank's incoming gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumOverGroup(torch.autograd.Function):
    """x -> sum of x over `group` (forward and backward are all-reduces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def row_sums(x_BT: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, T] -> [B]: each row's sum, over the chunks that `group`'s ranks hold (None: all here)."""
    s_B = x_BT.sum(1)
    return s_B if group is None else _SumOverGroup.apply(s_B, group)
