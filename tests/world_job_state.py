"""Process-wide state that a job in the shared gloo world (tests/gloo_world.py) may change, and
how a rank puts it back, so that each job sees what a freshly started world would show it."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class FreshState:
    """Process-wide state a job may change, as it was before the first job."""

    def __init__(self, rng: dict[str, Any], dtype: Any, threads: int, environ: dict[str, str], cwd: str) -> None:
        self.rng, self.dtype, self.threads, self.environ, self.cwd = rng, dtype, threads, environ, cwd

    @classmethod
    def capture(cls) -> FreshState:
        return cls(_rng_states(), torch.get_default_dtype(), torch.get_num_threads(), dict(os.environ), os.getcwd())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Runs the body from this state; afterwards puts it back and destroys the body's groups."""
        # Fresh-world RNG: a job that draws without seeding gets what it got in its own world.
        _set_rng_states(self.rng)
        groups_before = set(c10d._world.pg_map)
        try:
            with torch.enable_grad():
                yield
        finally:
            torch.set_default_dtype(self.dtype)
            torch.set_num_threads(self.threads)  # GRPOTrainer sets train.compute.threads
            os.environ.clear()
            os.environ.update(self.environ)
            os.chdir(self.cwd)
        # Only after a success: a failed rank exits, and its peers' collectives may still be running.
        dist.barrier()
        for group in [g for g in c10d._world.pg_map if g not in groups_before]:
            dist.destroy_process_group(group)
        _clear_dtensor_caches()


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.random.get_rng_state(), "random": random.getstate()}
    with contextlib.suppress(ImportError):
        import numpy

        states["numpy"] = numpy.random.get_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.random.set_rng_state(states["torch"])
    random.setstate(states["random"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding propagation by op schema, and meshes of one shape compare equal: a
    cached output spec could carry an earlier job's mesh, whose groups are destroyed by now."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(propagator, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
