"""Tensor parallelism of a LoRA-adapted linear (`LoraLinear`), which torch's styles refuse (they take
an nn.Linear or an nn.Embedding only).

The adapter is split so that its merged weight W + s * B @ A comes out with the base weight's
placement, and the linear then runs as its plain counterpart does:

- column-parallel (W [out, in] Shard(0), bias Shard(0)): B [out, r] Shard(0), A [r, in] replicated;
  each rank merges its rows of W with its rows of B.
- row-parallel (W Shard(1), bias replicated): A Shard(1), B replicated; each rank merges its
  columns of W with its columns of A.

DTensor's addmm propagates those placements. The unmerged form (x W^T + s (x A^T) B^T) needs
nothing else: column-parallel, x A^T is whole on every rank and B's rows give this rank's output
columns; row-parallel, x A^T is a partial sum like x W^T, and both are summed by the style's
output. The gradient of a replicated factor comes out Partial and is summed over the tp ranks
with the others (GRPOStep._reduce_partial_grads).
`lora_aware` swaps the two styles into a block's plan where the target is adapted; their input
and output handling is the torch style's own.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanrl.models.common.lora import LORA_A, LORA_B, LoraLinear

Placements = dict[str, dict[str, Placement]]
"""{submodule of the LoraLinear ('' itself, 'lora_A', 'lora_B'): {parameter: placement}}."""

COLUMN: Placements = {"": {"weight": Shard(0), "bias": Shard(0)}, LORA_A: {"weight": Replicate()},
                      LORA_B: {"weight": Shard(0)}}
ROW: Placements = {"": {"weight": Shard(1), "bias": Replicate()}, LORA_A: {"weight": Shard(1)},
                   LORA_B: {"weight": Replicate()}}


def _partition(placements: Placements, src_data_rank: int | None, name: str, module: nn.Module,
               mesh: DeviceMesh) -> None:
    """distribute_module's partition_fn: each parameter of the LoraLinear and its factors becomes a
    DTensor of its placement, keeping requires_grad (the base frozen, the factors trained)."""
    for key, placement in placements.get(name, {}).items():
        param = module._parameters.get(key)
        if param is None:
            continue
        dist = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(key, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel that also takes a LoraLinear (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoraLinear):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, partial(_partition, COLUMN, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel that also takes a LoraLinear (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoraLinear):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets it for a linear
        return distribute_module(
            module, device_mesh, partial(_partition, ROW, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def _lora_style(style: ParallelStyle) -> ParallelStyle:
    """The LoRA-aware style with `style`'s layouts (exactly ColwiseParallel / RowwiseParallel)."""
    kind = {ColwiseParallel: LoraColwiseParallel, RowwiseParallel: LoraRowwiseParallel}.get(type(style))
    if kind is None:
        raise NotImplementedError(f"tensor parallelism of a LoRA-adapted linear under {style!r}: only column- "
                                  f"and row-parallel linears are built")
    lora = kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output)
    lora.src_data_rank = style.src_data_rank
    return lora


def lora_aware(block: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` (one block's {submodule path: style}) with the style of every LoRA-adapted target
    replaced by its LoRA-aware counterpart; the plan itself when nothing in it is adapted."""
    modules = dict(block.named_modules())
    adapted = {path for path in plan if isinstance(modules.get(path), LoraLinear)}
    if not adapted:
        return plan
    return {path: _lora_style(style) if path in adapted else style for path, style in plan.items()}
