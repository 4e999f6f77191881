"""Device-to-host copies of SPMD-sharded XLA tensors without a compile per copy.

`tensor.cpu()` on a sharded tensor makes torch_xla compile a small program that replicates it
(and compiles it again on every call: there is no cache for it), so a weight push of a sharded
policy cost one compile per weight per step. Here the shards are read off the devices as they
are and put together on the host; only a pending computation (a dtype cast) is compiled, once
per graph, and XLA's cache keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch_xla
import torch_xla.core.xla_model as xm

_UNSHARDED = ("", "{replicated}")
"""Sharding specs whose data every device holds whole (a plain transfer, no program)."""


def host_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors` (XLA or not), in order; pending XLA ones are computed in one program."""
    on_device = [t for t in tensors if t.device.type == "xla"]
    if on_device:
        xm.unlazy(on_device)
    return [_host(t) if t.device.type == "xla" else t for t in tensors]


def host_tree(tree: Any) -> Any:
    """`tree` (nested lists, tuples, dicts) with every tensor replaced by its `host_tensors` copy."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    where = [i for i, t in enumerate(leaves) if torch.is_tensor(t)]
    for i, t in zip(where, host_tensors([leaves[i] for i in where]), strict=True):
        leaves[i] = t
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _host(t: torch.Tensor) -> torch.Tensor:
    if torch_xla._XLAC._get_xla_sharding_spec(t) in _UNSHARDED:
        return t.cpu()
    (shards,) = torch_xla._XLAC._get_local_shards([t])
    (placements,) = torch_xla._XLAC._get_local_shard_replica_and_indices([t])
    out = torch.empty(t.shape, dtype=t.dtype)
    for (data, _device), (replica, index) in zip(shards, placements, strict=True):
        if replica != 0:
            continue  # another copy of a tile already taken
        # A tile at the end of an uneven split carries padding past the tensor's edge.
        unpadded = tuple(slice(0, s.stop - s.start) for s in index)
        out[tuple(index)] = data[unpadded]
    return out
