"""Learning-rate schedule: warm-up ramps up, cosine decays to min_ratio exactly at the last optimizer step."""

import pytest
import torch

from titanrl.config import LrScheduleConfig, OptimizerConfig, TrainConfig
from titanrl.trainer.lr_schedule import build_scheduler, lr_multiplier, total_optimizer_steps


def test_warmup_then_constant():
    """Warm-up rises strictly to 1 and constant stays at 1 afterwards."""
    ramp = [lr_multiplier(s, 100, 4, "constant", 0.1) for s in range(4)]
    assert ramp == sorted(ramp) and ramp[0] > 0 and ramp[-1] < 1
    assert ramp == [(s + 1) / 5 for s in range(4)]
    assert all(lr_multiplier(s, 100, 4, "constant", 0.1) == 1.0 for s in range(4, 100))


def test_cosine_reaches_min_ratio_at_the_last_step():
    """Cosine starts at 1 after warm-up, halves midway, is min_ratio at step total-1 and never below."""
    assert lr_multiplier(10, 111, 10, "cosine", 0.2) == 1.0
    assert lr_multiplier(60, 111, 10, "cosine", 0.2) == pytest.approx(0.6)
    assert lr_multiplier(110, 111, 10, "cosine", 0.2) == 0.2
    assert lr_multiplier(500, 111, 10, "cosine", 0.2) == 0.2
    values = [lr_multiplier(s, 111, 10, "cosine", 0.2) for s in range(10, 111)]
    assert values == sorted(values, reverse=True)


def test_single_step_after_warmup_is_the_last():
    """With one step after warm-up (or one step in all) that step is the last: it gets min_ratio."""
    assert lr_multiplier(3, 4, 3, "cosine", 0.25) == 0.25
    assert lr_multiplier(0, 1, 0, "cosine", 0.25) == 0.25


def _lrs_used(cfg: TrainConfig) -> list[float]:
    """The lr each optimizer step of a run uses, read from a real AdamW driven by build_scheduler."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=cfg.optimizer.lr)
    sched = build_scheduler(opt, cfg)
    used = []
    for _ in range(total_optimizer_steps(cfg)):
        used.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(2)
        opt.step()
        sched.step()
    return used


def test_scheduler_ends_exactly_at_min_lr():
    """steps=10, min_lr_ratio=0.1: the 10th optimizer step uses exactly 0.1 * lr (it used to use 0.122 * lr)."""
    cfg = TrainConfig(
        steps=10, optimizer=OptimizerConfig(lr=3e-4), lr_schedule=LrScheduleConfig(decay="cosine", min_lr_ratio=0.1)
    )
    used = _lrs_used(cfg)
    assert len(used) == 10
    assert used[0] == pytest.approx(3e-4, rel=1e-12)
    assert used[-1] == pytest.approx(0.1 * 3e-4, rel=1e-12)
    assert min(used) == used[-1]


def test_scheduler_spans_every_optimizer_step_with_warmup():
    """With ppo_epochs and minibatches the schedule spans steps * epochs * minibatches optimizer steps;
    warm-up is unchanged ((s+1)/(w+1) * lr) and the last of them uses min_lr_ratio * lr."""
    cfg = TrainConfig(
        steps=3,
        ppo_epochs=2,
        minibatches=2,
        optimizer=OptimizerConfig(lr=1e-3),
        lr_schedule=LrScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.3),
    )
    assert total_optimizer_steps(cfg) == 12
    used = _lrs_used(cfg)
    assert used[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-12)
    assert used[-1] == pytest.approx(0.3 * 1e-3, rel=1e-12)
    assert used[2:] == sorted(used[2:], reverse=True)


def test_unknown_decay_is_an_error():
    """An unknown decay name is rejected with a message naming the valid ones."""
    with pytest.raises(ValueError, match="cosine"):
        lr_multiplier(5, 10, 0, "linear", 0.1)
