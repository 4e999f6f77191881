"""Pipeline parallel: the decoder split into consecutive stages (`PipelineStageModel`, from the
model's family), run by torch.distributed.pipelining."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from titanrl.config.parallel import PP_SCHEDULES
from titanrl.config.schema import ParallelConfig
from titanrl.models.common.pipeline_stage import PipelineStageModel


def num_stages(parallel: ParallelConfig) -> int:
    return parallel.pp * PP_SCHEDULES[parallel.pp_schedule] if parallel.pp > 1 else 1


def stages_of_rank(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Stage indices run by pipeline rank `pp_rank`: one, or r and r + pp when interleaved."""
    return [pp_rank + k * parallel.pp for k in range(num_stages(parallel) // parallel.pp)]


def build_schedule(parts: list[PipelineStageModel], parallel: ParallelConfig, mesh: DeviceMesh,
                   device: torch.device, n_microbatches: int, loss_fn):
    """A fresh pipeline schedule over this rank's stages (shapes are inferred on its first step)."""
    group = mesh["pp"].get_group()
    n = num_stages(parallel)
    stages = [PipelineStage(part, part.stage, n, device, group=group) for part in parts]
    if parallel.pp_schedule == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[parallel.pp_schedule]
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
