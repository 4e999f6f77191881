"""Memory planning for the trainer: what one GRPO step needs per rank under each parallel layout.

`shape` reads a config.json (dense Qwen3 or Qwen3-MoE), `memory` estimates each term of a rank's
peak, `communication` the bytes a rank sends per step, `layouts` enumerates and ranks the layouts
of N GPUs. `titanrl plan` (titanrl/commands/plan.py) prints them.
"""

from titanrl.planning.memory import Layout, MemoryEstimate, Workload, estimate, estimate_cpu_process
from titanrl.planning.shape import ModelShape, PlanInputError

__all__ = ["Layout", "MemoryEstimate", "ModelShape", "PlanInputError", "Workload", "estimate", "estimate_cpu_process"]
