"""The XLA runtime of one trainer process: its device, the SPMD mesh of `ParallelConfig`, and the
compile counters the step reports.

On XLA the parallel degrees describe one device mesh that this single process drives (SPMD):
`dp_replicate x dp_shard x tp` must equal the devices torch_xla sees (`CPU_NUM_DEVICES` on XLA's
CPU device), or be 1 (everything replicated). Parameters are sharded FSDP-style over
`dp_shard` and Megatron-style over `tp` by annotation; XLA's partitioner inserts the
collectives, so the program computes what the unsharded one does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from titanrl.config.schema import ParallelConfig
from titanrl.models.architectures import spec_for
from titanrl.models.common.parallelize import ParallelPlan
from titanrl.errors import ConfigError
from titanrl.config.xla_env import SPMD_DEGREES, check_xla_layout, mesh_size
from titanrl.trainer.xla.update import masked_step

try:
    import torch_xla
    import torch_xla.debug.metrics as xla_metrics
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
except ImportError as e:  # pragma: no cover - the main venv has no torch_xla
    raise ConfigError(
        f"train.compute.device='xla' needs torch_xla in the trainer's Python environment ({e}); build it with "
        f"`make xla-venv` and run the trainer there, or set train.compute.device='cpu'") from e

from titanrl.trainer.xla.transfer import host_tree  # noqa: E402 (after the torch_xla check)

ROW_AXES = ("dp_replicate", "dp_shard")
"""Mesh axes the batch's rows are split over (data parallel)."""



class XlaRuntime:
    """The XLA device and SPMD mesh of this process (built before any tensor reaches the device)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        xr.use_spmd()  # idempotent; before the first tensor reaches the device
        self.device = torch_xla.device()
        self.devices = xr.global_runtime_device_count()
        check_xla_layout(parallel, self.devices)
        shape = tuple(getattr(parallel, d) for d in SPMD_DEGREES)
        self.sharded = mesh_size(parallel) > 1
        self.mesh = xs.Mesh(np.arange(self.devices), shape if self.sharded else (self.devices, 1, 1), SPMD_DEGREES)
        self._specs: dict[int, tuple] = {}
        """Partition spec of every parameter, by id()."""
        self._compiles_seen, self._compile_s_seen = self._compile_totals()

    @staticmethod
    def check_model(config: Any) -> None:
        """Refuses a mixture-of-experts policy (its routing replay and metrics read the device
        inside the step; not ported to XLA)."""
        if spec_for(config).is_moe:
            raise ConfigError(f"a mixture-of-experts model (model.checkpoint holds {config.FAMILY}) is not supported "
                              "with train.compute.device='xla': use a dense checkpoint or train.compute.device='cpu'")

    # ------------------------------------------------------------------ sharding

    def shard_model(self, model: nn.Module) -> None:
        """Annotates every parameter with its SPMD sharding, replicated ones explicitly: a step's
        outputs carry an annotation, so unannotated first inputs would make the first step a
        program of its own."""
        plan = spec_for(model.config).parallel_plan
        for name, p in model.named_parameters():
            spec = self.parameter_spec(plan, name, p) or (None,) * p.dim()
            xs.mark_sharding(p, self.mesh, spec)
            self._specs[id(p)] = spec

    def parameter_spec(self, plan: ParallelPlan, name: str, p: torch.Tensor) -> tuple | None:
        """Partition spec of an HF-named parameter: 2-D weights over (tp, dp_shard) or
        (dp_shard, tp) as the family's plan says (`ParallelPlan.xla_weight_axes`); 1-D gains and
        biases replicated."""
        if not self.sharded or p.dim() != 2:
            return None
        return {"row": ("dp_shard", "tp"), "column": ("tp", "dp_shard"), "fsdp": ("dp_shard", None)}[
            plan.xla_weight_axes(name)]

    def shard_like(self, tensor: torch.Tensor, p: torch.Tensor) -> None:
        """Gives a tensor of a parameter's shape (an optimizer moment) the parameter's sharding."""
        spec = self._specs.get(id(p))
        if spec is not None and tensor.shape == p.shape:
            xs.mark_sharding(tensor, self.mesh, spec)

    def place_rows(self, t_B: torch.Tensor) -> torch.Tensor:
        """A per-row tensor [B, ...] on the device, its rows split over the data-parallel axes."""
        t_B = t_B.to(self.device)
        if self.sharded:
            xs.mark_sharding(t_B, self.mesh, (ROW_AXES,) + (None,) * (t_B.dim() - 1))
        return t_B

    # ------------------------------------------------------------------ execution

    def sync(self) -> None:
        """Cuts the traced graph here and runs it: one compiled program per distinct graph."""
        torch_xla.sync()

    @staticmethod
    def own_buffers(tree: Any) -> Any:
        """`tree` with every tensor cloned in the graph: a view read after the sync would be
        re-derived from its base by a small program of its own; a clone is an output buffer."""
        return torch.utils._pytree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, tree)

    def to_host(self, tree: Any) -> Any:
        """`tree` with every device tensor copied to the host (after `sync`: transfers, no compile,
        sharded ones included: transfer.py)."""
        return host_tree(tree)

    def masked_step(self, optimizers: list[torch.optim.Optimizer], take: torch.Tensor) -> Callable[[], None]:
        """AdamW's update traced into the step's program, applied only where `take` (update.py)."""
        return masked_step(optimizers, take, self.shard_like)

    @staticmethod
    def _compile_totals() -> tuple[int, float]:
        data = xla_metrics.metric_data("CompileTime")
        if data is None:
            return 0, 0.0
        count, total_ns, _ = data
        return int(count), total_ns / 1e9

    def compile_metrics(self) -> dict[str, float]:
        """xla/compiles, xla/compile_s: programs compiled by this trainer so far and their time."""
        count, seconds = self._compile_totals()
        return {"xla/compiles": float(count - self._compiles_seen), "xla/compile_s": seconds - self._compile_s_seen}
