"""`parallelize`: applies a ParallelConfig's layout to a DecoderForCausalLM on a device mesh.

Order: context parallel (swap attention backends), activation checkpointing flags, pipeline
split, then per stage tensor parallel, expert parallel (experts split over the ep ranks),
torch.compile of each block (train.compute.compile) and finally FSDP2 / HSDP over the data-parallel
(x context-parallel) ranks. A tied embedding split across pipeline stages gets its gradient-summing
group last (tied.py). The optimizers are built from the result
(titanrl.trainer.optimizer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanrl.config.schema import ActivationCheckpointing, ParallelConfig
from titanrl.kernels.onednn_linear import apply_onednn_linears
from titanrl.models.hf_checkpoint import tie_head
from titanrl.models.architectures import spec_for
from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM
from titanrl.trainer.parallel.activation_checkpoint import apply_activation_checkpointing
from titanrl.trainer.parallel.compile import apply_compile
from titanrl.trainer.parallel.fsdp import apply_fsdp
from titanrl.trainer.parallel.expert_parallel import apply_expert_parallel
from titanrl.trainer.parallel.mesh import coord, expert_meshes, fsdp_mesh
from titanrl.trainer.parallel.mixed_precision import apply_compute_dtype
from titanrl.trainer.parallel.pipeline import PipelineStageModel, num_stages, stages_of_rank
from titanrl.trainer.parallel.ring_attention import ContextLayout, RingAttention
from titanrl.trainer.parallel.tensor_parallel import apply_tensor_parallel, apply_vocab_parallel
from titanrl.trainer.parallel.tied import is_head_copy, split_tied, tied_group


@dataclass
class ParallelModel:
    """This rank's share of a parallelized policy."""

    parts: list[nn.Module]
    """Model parts on this rank: the whole (sharded) model, or its pipeline stages (HF parameter names)."""
    parallel: ParallelConfig
    """The layout applied."""
    mesh: DeviceMesh | None
    """World mesh with named dimensions (see mesh.build_mesh); None in a single process."""
    config: DecoderConfig
    """Architecture of the full model."""
    context: ContextLayout | None
    """Which sequence chunks this rank holds under context parallel; None without it."""
    device: torch.device
    """Device of this rank's parameters and activations."""
    tied_group: dist.ProcessGroup | None = None
    """Pipeline with tied embeddings: the {first, last pp rank} group that sums the tied copies'
    gradients (tied.py); None without a split tied matrix and on middle-stage ranks."""

    @property
    def split_tied(self) -> bool:
        """Whether the tied embedding / LM head matrix has a copy on the first and the last stage."""
        return split_tied(self.parallel.pp, self.config.tie_word_embeddings)

    @property
    def pipelined(self) -> bool:
        return self.parallel.pp > 1

    @property
    def num_stages(self) -> int:
        return num_stages(self.parallel)

    def named_parameters(self, head_copy: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """HF-named parameters held on this rank (sharded ones as DTensors), tied ones once.

        head_copy=False leaves out the last stage's LM head weight when it is a copy of the
        tied embedding (the first stage's is the one to count, save and publish).
        """
        for part in self.parts:
            for name, p in part.named_parameters():
                if head_copy or not (self.split_tied and is_head_copy(part, name)):
                    yield name, p

    def parameters(self, head_copy: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters(head_copy):
            yield p


def _is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _layers(part: nn.Module) -> list[nn.Module]:
    return part.decoder_layers()


def parallelize(model: DecoderForCausalLM, parallel: ParallelConfig, mesh: DeviceMesh | None,
                load_balance: bool = True, device_type: str = "cpu",
                activation_checkpointing: ActivationCheckpointing = "none",
                activation_checkpointing_every: int = 2,
                compute_dtype: torch.dtype | None = None, compile_blocks: bool = False,
                onednn_linears: bool = False) -> ParallelModel:
    """Shards `model` (a full copy, identical on every rank) for this rank; returns its parts.

    `model` must not be used directly afterwards: its modules now live in the returned parts.
    load_balance: context-parallel chunking that balances causal attention work (2 * cp chunks).
    activation_checkpointing(_every): which decoder blocks recompute activations in backward
    (TrainConfig's fields of those names).
    mesh None is a single process (`parallel` of world size 1): the model moves to `device_type`
    and stays whole. Call `validate_parallel` first for readable errors.
    compute_dtype: forward/backward dtype when it differs from the parameters' (mixed precision:
    FSDP2's MixedPrecisionPolicy, or mixed_precision.py's casts in a layout without FSDP); None or
    the parameters' dtype computes in that dtype.
    compile_blocks: each decoder block through torch.compile (train.compute.compile; compile.py).
    onednn_linears: the linear layers' GEMMs through oneDNN (train.compute.cpu_matmul; one CPU process only).
    """
    if mesh is None and parallel.world_size != 1:
        raise ValueError(f"a layout of {parallel.world_size} ranks needs a device mesh (see mesh.build_mesh)")
    device_type = mesh.device_type if mesh is not None else device_type
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    if not _is_meta(model):  # a meta model is materialised shard by shard after sharding (sharded_load.py)
        model = model.to(device)
        tie_head(model)  # where tensors cannot be swapped in place (XLA), .to gives each module its own copy
    if compute_dtype == next(model.parameters()).dtype:
        compute_dtype = None
    plan = spec_for(model.config).parallel_plan
    context = None
    if parallel.cp > 1:
        context = ContextLayout(parallel.cp, coord(mesh, "cp"), load_balance)
        group = mesh["cp"].get_group()
        for layer in model.decoder_layers():
            layer.set_submodule(plan.attention_core, RingAttention(group, context))
    # On the whole stack, before the pipeline split: blocks keep their global index.
    apply_activation_checkpointing(model.decoder_layers(), activation_checkpointing, activation_checkpointing_every)
    if parallel.pp > 1:
        n = num_stages(parallel)
        positions = context.positions if context is not None else None
        parts: list[nn.Module] = [
            PipelineStageModel(model, s, n, positions) for s in stages_of_rank(parallel, coord(mesh, "pp"))
        ]
    else:
        parts = [model]
    dp_mesh = fsdp_mesh(mesh)
    experts = expert_meshes(mesh)  # (ep mesh, expert FSDP mesh) under expert parallelism
    for part in parts:
        if parallel.tp > 1:
            apply_tensor_parallel(_layers(part), mesh["tp"], plan.tensor_parallel, parallel.sequence_parallel,
                                  experts_over_tp=experts is not None)
            apply_vocab_parallel(part, mesh["tp"])
        if experts is not None:
            apply_expert_parallel(plan.sparse_blocks(_layers(part)), experts[0], tokens_split_over_tp=parallel.tp > 1)
        if onednn_linears:
            apply_onednn_linears(part)
        if compile_blocks:
            apply_compile(_layers(part), plan.eager_parts)
        if dp_mesh is not None:
            apply_fsdp(part, _layers(part), dp_mesh, compute_dtype, expert_mesh=experts[1] if experts else None,
                       sparse_blocks=plan.sparse_blocks(_layers(part)))
        elif compute_dtype is not None:
            apply_compute_dtype(part, compute_dtype)
        part.train()
    group = tied_group(mesh) if split_tied(parallel.pp, model.config.tie_word_embeddings) else None
    return ParallelModel(parts, parallel, mesh, model.config, context, device, group)

