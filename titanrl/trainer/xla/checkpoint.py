"""Training checkpoints of the XLA trainer in the CPU trainer's format.

torch.distributed.checkpoint reads and writes host tensors, so the XLA trainer saves through a
CPU copy of its policy and AdamW (the same `save_training_checkpoint` / `load_model_optim` as
every layout) and loads into one, then copies the result onto the device: a checkpoint written
on XLA loads into the CPU trainer and back.
"""

from __future__ import annotations

import torch

from titanrl.config.schema import ParallelConfig, TrainConfig
from titanrl.models.hf_checkpoint import empty_model
from titanrl.trainer.optimizer import LAYOUT_KEYS, build_optimizers
from titanrl.trainer.parallel.parallelize import ParallelModel, parallelize
from titanrl.trainer.xla.transfer import host_tree


def host_copy(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], train_config: TrainConfig
              ) -> tuple[ParallelModel, list[torch.optim.Optimizer]]:
    """A CPU ParallelModel and AdamW holding the device policy's weights and optimizer state."""
    (model,) = pm.parts
    (opt,) = optimizers
    dtype = next(model.parameters()).dtype
    cpu = empty_model(pm.config, dtype)
    cpu.load_state_dict(host_tree(model.state_dict()))
    cpu_pm = parallelize(cpu, ParallelConfig(), None, device_type="cpu")
    (cpu_opt,) = build_optimizers(cpu_pm, train_config)
    if opt.state:
        cpu_opt.load_state_dict(_with_layout(host_tree(opt.state_dict()), cpu_opt))
    return cpu_pm, [cpu_opt]


@torch.no_grad()
def copy_to_device(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], host_pm: ParallelModel,
                   host_optimizers: list[torch.optim.Optimizer]) -> None:
    """Loads a `host_copy`'s (possibly changed) weights and optimizer state back into the device
    policy in place (the parameters keep their identity and SPMD sharding)."""
    (model,), (cpu,) = pm.parts, host_pm.parts
    (opt,), (cpu_opt,) = optimizers, host_optimizers
    cpu_params = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        p.copy_(cpu_params[name].to(p.device))
    opt.state.clear()
    if cpu_opt.state:
        opt.load_state_dict(_with_layout(cpu_opt.state_dict(), opt))


def _with_layout(state: dict, target: torch.optim.Optimizer) -> dict:
    """`state` (an optimizer state dict) with the target optimizer's layout choices (fused /
    foreach): they decide where `load_state_dict` puts the step counters."""
    groups = [{**g, **{k: t[k] for k in LAYOUT_KEYS if k in t}}
              for g, t in zip(state["param_groups"], target.param_groups, strict=True)]
    return {**state, "param_groups": groups}
