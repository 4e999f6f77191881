"""Which `ParallelConfig` layouts the XLA trainer runs (no torch_xla import: config validation
calls it in any environment)."""

from __future__ import annotations

from titanrl.config.schema import ParallelConfig
from titanrl.errors import ConfigError

SPMD_DEGREES = ("dp_replicate", "dp_shard", "tp")
"""Degrees that become axes of the XLA SPMD mesh (in this order)."""

UNSUPPORTED = ("pp", "cp", "ep")
"""Degrees with no SPMD form here: pipeline, ring-attention context and expert parallel."""


def check_xla_layout(parallel: ParallelConfig, devices: int | None = None) -> None:
    """Refuses a layout the XLA trainer does not run. devices: what torch_xla sees (None: not
    known here, e.g. in the driver's environment); the mesh must cover them all, or be 1."""
    for name in UNSUPPORTED:
        if getattr(parallel, name) != 1:
            raise ConfigError(f"train.parallel.{name}={getattr(parallel, name)} is not supported with "
                              f"train.device='xla' (SPMD shards {', '.join(SPMD_DEGREES)}): set it to 1")
    size = mesh_size(parallel)
    if devices is not None and size not in (1, devices):
        raise ConfigError(
            f"train.parallel dp_replicate x dp_shard x tp = {size} but torch_xla sees {devices} devices "
            f"(CPU_NUM_DEVICES on XLA's CPU device): make the product equal the device count, or 1")


def mesh_size(parallel: ParallelConfig) -> int:
    """Devices of the SPMD mesh `parallel` describes."""
    return parallel.dp_replicate * parallel.dp_shard * parallel.tp
