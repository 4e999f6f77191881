"""Gradients added straight into `.grad`: the embedding's and the LM head's, in one process.

From a step's second micro-batch on, a Parameter already holds the accumulated gradient. The
embedding's backward and the head's (`titanrl.trainer.chunked_logprobs`) each make a dense
[vocab, hidden] float32 gradient that autograd then adds to it: two model-sized rows of the
vocabulary beside `.grad` at the step's peak (1.16 GiB at Qwen3-0.6B's shape). Where nothing else
reads the returned gradient, the backward adds its part to `.grad` itself and returns none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def grad_accumulates_in_place(weight: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether a backward may add `weight`'s gradient into `weight.grad` (when one is there) instead of
    returning it: a plain float32 leaf Parameter in one process, with no hook that reads its
    accumulated gradient (FSDP, tensor and vocabulary parallelism keep the returned gradient)."""
    return (
        type(weight) is nn.Parameter and weight.dtype == torch.float32 and weight.device.type in ("cpu", "cuda")
        and group is None and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    )


def holds_gradient(weight: torch.Tensor | None, like: torch.Tensor) -> bool:
    """`weight` (a Parameter chosen by `grad_accumulates_in_place`, or None) already has a float32
    gradient of `like`'s shape to add into."""
    return (weight is not None and weight.grad is not None and weight.grad.dtype == torch.float32
            and weight.grad.shape == like.shape)


class _EmbeddingGradInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(ids)
        ctx.weight_param = weight
        return nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205
        (ids,) = ctx.saved_tensors
        weight = ctx.weight_param
        rows, flat = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if holds_gradient(weight, weight):
            weight.grad.index_add_(0, rows, flat.to(torch.float32))
            return None, None
        grad = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
        return None, grad.index_add_(0, rows, flat.to(weight.dtype))


def embed(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """`module(ids)`, with its weight's gradient added in place (`grad_accumulates_in_place`) when
    gradients are on and nothing hooks the module (FSDP and tensor parallelism do)."""
    weight = module.weight
    if (torch.is_grad_enabled() and weight.requires_grad and grad_accumulates_in_place(weight)
            and not module._forward_hooks and not module._forward_pre_hooks and module.padding_idx is None
            and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse):
        return _EmbeddingGradInPlace.apply(ids, weight)
    return module(ids)
