"""The trainer's parallel layouts: validation, device mesh, parallelize, the distributed GRPO step.

`validate_parallel` checks a `ParallelConfig` against the model before any process starts;
`build_mesh` names the mesh dimensions; `parallelize` applies FSDP2 / HSDP, tensor (+sequence)
parallel, pipeline stages, ring-attention context parallel and expert parallel (MoE experts
split over borrowed ranks, tokens exchanged by all-to-all); `ParallelGRPOStep` runs one GRPO
gradient accumulation whose loss and gradients equal the single-process trainer's.
"""

from titanrl.trainer.parallel.checkpoint import load_model_optim, save_model_optim
from titanrl.trainer.parallel.gather import iter_full_gradients, iter_full_weights
from titanrl.trainer.parallel.mesh import MESH_DIMS, build_mesh, init_distributed
from titanrl.trainer.parallel.parallelize import ParallelModel, parallelize
from titanrl.trainer.parallel.step import ParallelGRPOStep
from titanrl.config.parallel import validate_parallel

__all__ = [
    "MESH_DIMS",
    "ParallelGRPOStep",
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
