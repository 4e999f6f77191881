"""Which weight transport a run uses: `rollout.weight_transport`, with 'auto' decided here.

'auto' picks `shared_memory` when it is sure to work: the driver started Ray itself (so every
node is this machine), the rollout engines run on CPU, and /dev/shm can hold the
`MAX_SEGMENTS` segments the sender may keep (a tmpfs grows a segment page by page, so one that
does not fit fails with SIGBUS mid-push, long after start-up; Docker's default /dev/shm is
64 MiB). Everywhere else it picks `object_store`, which works on any cluster. On a 2-core CPU
a push of the 25M model (in-process engines, `rollout.engine.vllm_kernels=false`) costs 2.1-2.3x a
memory copy by shared memory against 8.0-8.3x through the object store (`benchmarks/weight_sync.py`).

An explicit `shared_memory` that /dev/shm cannot hold is refused before any actor starts.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from titanrl.config import RunConfig
from titanrl.errors import ConfigError

log = logging.getLogger("titanrl")

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory segments live on Linux."""


def push_bytes(config: RunConfig) -> int | None:
    """Bytes of one pushed version: every parameter in the generator's dtype (the trainer's compute
    dtype); None when the checkpoint's config.json does not say (then nothing is assumed)."""
    from titanrl.planning.memory import DTYPE_BYTES
    from titanrl.planning.shape import ModelShape, PlanInputError

    try:
        shape = ModelShape.from_config_json(Path(config.model.checkpoint))
    except (PlanInputError, OSError, KeyError, TypeError, ValueError):
        return None
    return shape.total_params * DTYPE_BYTES[config.generator_dtype]


def shm_free_bytes(directory: str = SHM_DIR) -> int | None:
    """Free bytes in `directory`'s file system, None where it does not exist (not Linux)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def choose_weight_transport(config: RunConfig, rollout_device: str, shm_free: int | None) -> str:
    """The WeightSyncPlan transport for `config` (`rollout.weight_transport`, 'auto' resolved), given
    the rollout engines' device and the free bytes of /dev/shm (None: unknown).

    Raises ConfigError when an explicit 'shared_memory' cannot fit /dev/shm on this machine.
    """
    from titanrl.weight_sync.shared_memory import MAX_SEGMENTS

    transport = config.rollout.weight_transport
    local = config.ray_address is None
    if transport not in ("auto", "shared_memory") or not local:
        return "object_store" if transport == "auto" else transport
    one = push_bytes(config)
    need = MAX_SEGMENTS * one if one is not None else None
    fits = shm_free is not None and need is not None and shm_free >= need
    if transport == "shared_memory":
        if shm_free is not None and need is not None and not fits:
            raise ConfigError(
                f"rollout.weight_transport='shared_memory' needs up to {need / 2**20:.0f} MiB in {SHM_DIR} "
                f"({MAX_SEGMENTS} versions of the model), which has {shm_free / 2**20:.0f} MiB free: enlarge it "
                "(docker run --shm-size=...) or set rollout.weight_transport='object_store'")
        return transport
    if rollout_device == "cpu" and fits:
        return "shared_memory"
    if rollout_device != "cpu":
        why = "engines on a GPU"
    elif need is None:
        why = f"the model's size is unknown ({config.model.checkpoint}/config.json)"
    else:
        why = f"{SHM_DIR} has {0 if shm_free is None else shm_free / 2**20:.0f} MiB free, not {need / 2**20:.0f}"
    log.info(f"rollout.weight_transport='auto': object_store ({why})")
    return "object_store"
