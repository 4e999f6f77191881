"""Learning-rate multipliers: linear warm-up, then constant or cosine decay.

Steps are *optimizer* steps: one `GRPOTrainer.step` call takes
`ppo_epochs * minibatches` of them, so a run's schedule spans
`train.steps * ppo_epochs * minibatches` optimizer steps.
"""

from __future__ import annotations

import math

import torch

from titanrl.config.schema import TrainConfig


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based) of `total_steps`.

    Warm-up steps 0..warmup-1 ramp linearly below 1. Cosine decay starts at 1 on the first
    step after warm-up and reaches exactly `min_ratio` on the last step, `total_steps - 1`
    (when only one step follows warm-up it is the last one, so it gets `min_ratio`).
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    if decay == "cosine":
        span = total_steps - 1 - warmup_steps  # index distance from the first decayed step to the last
        progress = 1.0 if span <= 0 else min(max(step - warmup_steps, 0) / span, 1.0)
        if progress == 1.0:
            return min_ratio  # exact: the formula below can be off by an ulp
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay {decay!r}: use 'constant' or 'cosine'")


def total_optimizer_steps(cfg: TrainConfig) -> int:
    """Optimizer steps in a run: every trainer step does `ppo_epochs * minibatches` of them."""
    return cfg.steps * cfg.ppo_epochs * cfg.minibatches


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over the run's optimizer steps; call its `step()` after each optimizer step taken."""
    total = total_optimizer_steps(cfg)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, total, cfg.lr_schedule.warmup_steps, cfg.lr_schedule.decay, cfg.lr_schedule.min_lr_ratio
        ),
    )


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """`scheduler.load_state_dict` for a state saved with any number of param groups.

    Every group follows the one schedule of train.optimizer.lr, so per-group lists of another length
    (an older checkpoint with a single param group, before decay / no_decay) are spread over
    this optimizer's groups.
    """
    groups = len(scheduler.optimizer.param_groups)
    state = dict(state)
    for key in ("base_lrs", "_last_lr"):
        values = state.get(key)
        if values is not None and len(values) != groups:
            if len(set(values)) != 1:
                raise ValueError(f"lr scheduler state has {len(values)} different {key} for {groups} param groups")
            state[key] = [values[0]] * groups
    scheduler.load_state_dict(state)
