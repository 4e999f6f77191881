"""Checkpoints of the XLA trainer are the CPU trainer's: a training checkpoint saved on XLA
resumes on CPU and back, and the HF export loads into the CPU trainer."""

import pytest
import torch

from groups import make_groups
from helpers import host_weights, trainer

GROUPS = [[5, 7, 3], [6, 2]]


def _moments(tr) -> dict[str, dict[str, torch.Tensor]]:
    names = {p: n for n, p in tr.model.named_parameters()}
    return {names[p]: {k: v.cpu() for k, v in s.items()} for p, s in tr.optimizer.state.items()}


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_equal(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_training_checkpoint_goes_from_xla_to_cpu_and_back(tiny_ckpt, tmp_path):
    """XLA steps and saves; the CPU trainer loads the same weights and AdamW moments bit for bit,
    steps and saves; a fresh XLA trainer loads those bits and its next step matches the CPU
    trainer's next step (1e-5)."""
    xla = trainer(tiny_ckpt, "xla")
    xla.step(make_groups(GROUPS, seed=1))
    xla.save_state(str(tmp_path / "from_xla"))
    cpu = trainer(tiny_ckpt, "cpu")
    assert cpu.load_state(str(tmp_path / "from_xla")) == 1
    _assert_equal(host_weights(cpu), host_weights(xla))
    _assert_equal(_moments(cpu), _moments(xla))
    cpu.step(make_groups(GROUPS, seed=2))
    cpu.save_state(str(tmp_path / "from_cpu"))
    back = trainer(tiny_ckpt, "xla")
    assert back.load_state(str(tmp_path / "from_cpu")) == 2
    _assert_equal(host_weights(back), host_weights(cpu))
    _assert_equal(_moments(back), _moments(cpu))
    groups = make_groups(GROUPS, seed=3)
    xla_m, cpu_m = back.step(groups), cpu.step(groups)
    assert abs(xla_m["loss"] - cpu_m["loss"]) <= 1e-5
    assert max((host_weights(back)[k] - w).abs().max().item() for k, w in host_weights(cpu).items()) <= 1e-5


def test_hf_export_loads_into_the_cpu_trainer(tiny_ckpt, tmp_path):
    """`save` on XLA writes HF safetensors the CPU trainer starts from, with the same weights."""
    xla = trainer(tiny_ckpt, "xla")
    xla.step(make_groups(GROUPS, seed=4))
    path = xla.save(str(tmp_path / "hf"))
    _assert_equal(host_weights(trainer(path, "cpu")), host_weights(xla))
