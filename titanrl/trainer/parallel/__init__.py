"""The trainer's parallel layouts: validation, device mesh, parallelize, checkpoints, gathers.

`validate_parallel` checks a `ParallelConfig` against the model before any process starts;
`build_mesh` names the mesh dimensions; `parallelize` applies FSDP2 / HSDP, tensor (+sequence)
parallel, pipeline stages, ring-attention context parallel and expert parallel (MoE experts
split over borrowed ranks, tokens exchanged by all-to-all). The GRPO step that runs on every
layout, a single process included, is `titanrl.trainer.step.GRPOStep`.
"""

from titanrl.trainer.parallel.checkpoint import load_model_optim, save_model_optim
from titanrl.trainer.parallel.gather import iter_full_gradients, iter_full_weights
from titanrl.trainer.parallel.mesh import MESH_DIMS, build_mesh, init_distributed
from titanrl.trainer.parallel.parallelize import ParallelModel, parallelize
from titanrl.config.parallel import validate_parallel

__all__ = [
    "MESH_DIMS",
    "ParallelModel",
    "build_mesh",
    "init_distributed",
    "iter_full_gradients",
    "iter_full_weights",
    "load_model_optim",
    "parallelize",
    "save_model_optim",
    "validate_parallel",
]
