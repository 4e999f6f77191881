"""Trainers and gradients shared by the XLA tests (the CPU trainer runs in the same torch 2.9 process)."""

import torch

from titanrl.config import ModelConfig, TrainConfig
from titanrl.config.schema import (
    ComputeConfig,
    MemoryConfig,
    OptimizerConfig,
    ParallelConfig,
)
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer

TINY = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
"""A one-layer model: XLA's compile time grows with the graph, and nothing here needs depth."""


def trainer(ckpt, device: str, parallel: ParallelConfig | None = None) -> GRPOTrainer:
    cfg = TrainConfig(compute=ComputeConfig(device=device), optimizer=OptimizerConfig(grad_clip=0.5),
                      memory=MemoryConfig(micro_batch_size=4), parallel=parallel or ParallelConfig())
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), cfg, temperature=1.0, seed=0))


def host_grads(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu() for n, p in tr.model.named_parameters()}


def host_weights(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in tr.model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
