"""The device mesh: one named dimension per kind of parallelism, size-1 dimensions left out.

A single-process trainer has no mesh (`None`): every helper here treats it as a world of one,
so the trainer's step runs the same code for one process and for N.

Dimension order, outermost first: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its
ranks are neighbours (one host, the fastest links); PP is outermost (least traffic).

Expert parallelism adds no dimension: its ep ranks are borrowed (TorchTitan's rule). With
tp > 1 they are the tp ranks (ep == tp); otherwise dp_shard is viewed as (efsdp, ep), ep
innermost, so an ep group is ep neighbouring data-parallel ranks and expert weights are
FSDP-sharded over the efsdp (x dp_replicate) ranks that hold the same experts (`expert_meshes`).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from titanrl.config.schema import ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, outermost first (ep borrows ranks: see `expert_meshes`)."""

FLATTENED = {"dp_shard_cp": ("dp_shard", "cp")}
"""Flattened dimensions built by `build_mesh`: FSDP shards over dp_shard x cp, since CP ranks
hold the same parameters and their gradients must be summed like data-parallel ones."""

EXPERT_DIMS = {"efsdp": ("dp_shard",), "ep": ("dp_shard",)}
"""Dimensions of the expert mesh (dp_shard viewed as efsdp x ep) and the base dimension each splits."""


def resolve_device_type(device: str) -> str:
    """'auto' | 'cpu' | 'cuda' | 'xla' -> the device type ('auto' picks CUDA when present; 'xla'
    is never picked automatically: it needs the torch_xla environment)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda", "xla"):
        raise ValueError(f"train.compute.device must be 'auto', 'cpu', 'cuda' or 'xla', got {device!r}")
    return device


def init_distributed(device_type: str, timeout_s: float = 300.0) -> None:
    """Joins the torch.distributed world described by the usual env vars (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK): NCCL on CUDA, gloo on CPU. No-op when already joined."""
    if dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))


def _degrees(parallel: ParallelConfig) -> dict[str, int]:
    return {name: getattr(parallel, name) for name in MESH_DIMS}


def build_mesh(parallel: ParallelConfig, device_type: str) -> DeviceMesh:
    """A DeviceMesh over the whole world with the dimensions of `parallel` that are > 1.

    dp_shard stays (size 1) when dp_replicate > 1, so HSDP / pure replication always find a 2-D
    (dp_replicate, dp_shard) mesh; a world of one gets a single size-1 "dp_shard" dimension.
    With ep > 1 the mesh also keeps the expert views (`expert_meshes`); validate_parallel
    checks ep's rule first.
    """
    degrees = _degrees(parallel)
    names = [n for n in MESH_DIMS if degrees[n] > 1 or (n == "dp_shard" and degrees["dp_replicate"] > 1)]
    if not names:
        names = ["dp_shard"]
    shape = tuple(degrees[n] for n in names)
    world = dist.get_world_size()
    if parallel.world_size != world:
        raise ValueError(f"the parallel layout needs {parallel.world_size} processes, the world has {world}")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(names))
    # Flattened views are kept here: slicing them back out of the root mesh is deprecated.
    mesh.titanrl_flattened = {}
    if "dp_shard" in names and "cp" in names:
        mesh.titanrl_flattened["dp_shard_cp"] = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh.titanrl_experts = _build_expert_meshes(mesh, parallel) if parallel.ep > 1 else None
    return mesh


def _build_expert_meshes(mesh: DeviceMesh, parallel: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh | None]:
    if parallel.tp > 1:  # ep == tp: experts over the tp ranks, FSDP-sharded like the dense weights
        return mesh["tp"], fsdp_mesh(mesh)
    # dp_shard as (efsdp, ep): an unflattened view of the same root mesh, so FSDP2 can combine
    # the ep-sharded expert DTensors with the efsdp mesh (size 1 when ep == dp_shard).
    experts = mesh._unflatten("dp_shard", (parallel.dp_shard // parallel.ep, parallel.ep), ("efsdp", "ep"))
    fsdp = experts["dp_replicate", "efsdp"] if has_dim(mesh, "dp_replicate") else experts["efsdp"]
    return experts["ep"], fsdp


def expert_meshes(mesh: DeviceMesh | None) -> tuple[DeviceMesh, DeviceMesh | None] | None:
    """(ep mesh, expert FSDP mesh) under expert parallelism, None without it.

    The ep mesh is the 1-D group that splits each sparse layer's experts (Shard(0)) and trades
    tokens with all-to-alls; the FSDP mesh shards each expert slice over the ranks holding the
    same experts (of size 1 when ep == dp_shard; None when ep == tp without data parallelism).
    """
    return getattr(mesh, "titanrl_experts", None) if mesh is not None else None


def global_rank() -> int:
    """This process's rank in the torch.distributed world; 0 in a single process."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(tensor: torch.Tensor, mesh: DeviceMesh | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """In-place all-reduce over the world of `mesh`; nothing to do in a single process."""
    if mesh is not None:
        dist.all_reduce(tensor, op=op)


def barrier(mesh: DeviceMesh | None) -> None:
    """Waits for every rank of `mesh`'s world; nothing to wait for in a single process."""
    if mesh is not None:
        dist.barrier()


def has_dim(mesh: DeviceMesh | None, name: str) -> bool:
    return mesh is not None and name in (mesh.mesh_dim_names or ())


def dim_size(mesh: DeviceMesh | None, name: str) -> int:
    """Size of a (base) mesh dimension; 1 when it was left out."""
    return mesh.size(mesh.mesh_dim_names.index(name)) if has_dim(mesh, name) else 1


def coord(mesh: DeviceMesh | None, name: str) -> int:
    """This rank's index along a (base) mesh dimension; 0 when it was left out."""
    return mesh.get_local_rank(name) if has_dim(mesh, name) else 0


def submesh(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    """The 1-D mesh of a base or flattened dimension, or None when it is absent."""
    if has_dim(mesh, name):
        return mesh[name]
    return getattr(mesh, "titanrl_flattened", {}).get(name) if mesh is not None else None


def dp_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This rank's data-parallel index and the data-parallel degree (replicate x shard)."""
    shard = dim_size(mesh, "dp_shard")
    return coord(mesh, "dp_replicate") * shard + coord(mesh, "dp_shard"), dim_size(mesh, "dp_replicate") * shard


def fsdp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: dp_shard (x cp), with dp_replicate as HSDP's outer dimension."""
    shard = [d for d in ("dp_shard", "cp") if has_dim(mesh, d)]
    if not shard:
        return None
    shard_name = "dp_shard_cp" if len(shard) == 2 else shard[0]
    if has_dim(mesh, "dp_replicate"):
        return mesh["dp_replicate", shard_name]  # HSDP: a 2-D slice (with a flattened dim when cp > 1)
    return submesh(mesh, shard_name)


def _base_dims(name: str) -> tuple[str, ...]:
    return FLATTENED.get(name) or EXPERT_DIMS.get(name, (name,))


def replicated_dims(mesh: DeviceMesh, tensor: torch.Tensor) -> set[str]:
    """Base mesh dimensions over which `tensor` holds the same values on every rank.

    A DTensor is replicated over its Replicate mesh dims and over every world dim outside its
    mesh; a plain tensor over every dim. pp never counts: stages hold different parameters.
    """
    world = {n for n in mesh.mesh_dim_names if n not in FLATTENED} - {"pp"}
    if not isinstance(tensor, DTensor):
        return world
    covered, replicated = set(), set()
    for name, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements, strict=True):
        dims = set(_base_dims(name))
        covered |= dims
        if isinstance(placement, Replicate):
            replicated |= dims
        elif placement.is_partial():
            raise ValueError(f"unexpected placement {placement} on mesh dim {name!r}: reduce partial gradients first")
    return replicated | (world - covered)


def owns(mesh: DeviceMesh | None, tensor: torch.Tensor) -> bool:
    """Whether this rank is the one that counts `tensor`'s local values in a world-wide sum."""
    if mesh is None:
        return True
    return all(coord(mesh, d) == 0 for d in replicated_dims(mesh, tensor))
