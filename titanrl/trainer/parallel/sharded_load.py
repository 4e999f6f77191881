"""A parallel policy built without a full model on any rank.

The model is built on the meta device (shapes, no storage), parallelized there (FSDP2's
`fully_shard` and the tensor-parallel plan only rewrite parameters into DTensors of local
shapes), and only then materialised: `to_empty` allocates each rank's shards and nothing else.
Each rank then fills them from the checkpoint, reading only its own blocks: from the
safetensors files of an HF directory (a block per parameter, located by its DTensor's local
shape and global offset), or from a training checkpoint through DCP, which reads the saved
chunks that overlap the rank's shards. A pipeline rank materialises only its stages' modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titanrl.config.schema import ParallelConfig
from titanrl.models.common.lora import adapter_parameters, add_adapters, initial_adapters
from titanrl.models.hf_checkpoint import CheckpointTensors, empty_meta_model, read_parameter, tie_head
from titanrl.models.qwen3.moe import routing_buffers, zero_routing_buffers
from titanrl.trainer.checkpoint import InitialPolicy
from titanrl.trainer.parallel.checkpoint import load_model_weights
from titanrl.trainer.parallel.parallelize import ParallelModel, parallelize


@dataclass(frozen=True)
class Adapters:
    """The LoRA adapters a sharded policy is built with (`add_adapters`' arguments)."""

    targets: tuple[str, ...]
    """Leaf names of the adapted linears."""
    rank: int
    """Rank r of every adapter."""
    alpha: float
    """Scale numerator (scale = alpha / rank)."""
    seed: int
    """Seed of the adapters' initialisation (the run's seed)."""
    unmerged: bool = False
    """The form they compute in (`LoraLinear.unmerged`: lora.sync='adapter')."""


def local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's block of `param` (its local tensor, writable) and the block's offset in the full
    tensor; a plain tensor is its own block at offset 0."""
    if not isinstance(param, DTensor):
        return param.detach(), (0,) * param.dim()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the block {shape} its placements imply")
    return local, tuple(offset)


def materialize(pm: ParallelModel) -> None:
    """Allocates (uninitialised) storage for this rank's shards of a meta-built ParallelModel."""
    for part in pm.parts:
        biases = routing_buffers(part)
        if any(True for name, _ in part.named_buffers() if name not in biases):
            raise RuntimeError("sharded loading fills parameters only; this model has buffers, which to_empty "
                               "would leave uninitialised")
        part.to_empty(device=pm.device)
        zero_routing_buffers(part, pm.device)  # the routers' expert biases start at zero (HF files have none)
        tie_head(part)


@torch.no_grad()
def load_hf_shards(pm: ParallelModel, tensors: CheckpointTensors) -> None:
    """Fills every parameter on this rank with its block of the checkpoint's tensor (cast to the
    parameter's dtype); a split tied matrix's two copies both read the embedding. LoRA adapter
    factors, which an HF checkpoint does not hold, are left alone (`init_adapter_shards`)."""
    for part in pm.parts:
        adapters = adapter_parameters(part)
        for name, param in part.named_parameters():
            if name not in adapters:
                block, offset = local_block(param)
                read_parameter(tensors, name, pm.config, block, offset)


@torch.no_grad()
def init_adapter_shards(pm: ParallelModel, seed: int) -> None:
    """Fills this rank's blocks of the LoRA adapter factors with the values `add_adapters(..., seed)`
    gives the whole model in one process (`initial_adapters`: A Kaiming-uniform, B zeros)."""
    for part in pm.parts:
        initial = initial_adapters(part, seed)
        for name, param in adapter_parameters(part).items():
            block, offset = local_block(param)
            full = initial[name]
            block.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, block.shape, strict=True))])


def build_sharded_policy(policy: InitialPolicy, dtype: torch.dtype, parallel: ParallelConfig,
                         mesh: DeviceMesh, adapters: Adapters | None = None,
                         **parallelize_options: Any) -> ParallelModel:
    """This rank's share of the policy in `dtype`, loaded shard by shard (call on every rank);
    `parallelize_options` go to `parallelize` (mixed precision, activation checkpointing).
    adapters: LoRA; the (meta) model is frozen and gets them before it is parallelized, so the
    layout shards them with their linears; they start as one process's `add_adapters` would."""
    model = empty_meta_model(policy.config, dtype)
    if adapters is not None:
        add_adapters(model, adapters.targets, adapters.rank, adapters.alpha, adapters.seed, adapters.unmerged)
    pm = parallelize(model, parallel, mesh, **parallelize_options)
    materialize(pm)
    if policy.hf_tensors is not None:
        load_hf_shards(pm, policy.hf_tensors)
    else:
        load_model_weights(pm, policy.dcp_dir)
    if adapters is not None:
        init_adapter_shards(pm, adapters.seed)
    return pm
