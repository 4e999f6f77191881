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


def _moved(source, target, path, version: int):
    """`source`'s training state saved and loaded into `target`: weights and AdamW moments bitwise."""
    source.save_state(str(path))
    assert target.load_state(str(path)) == version
    _assert_equal(host_weights(target), host_weights(source))
    _assert_equal(_moments(target), _moments(source))
    return target


def test_training_checkpoint_goes_from_xla_to_cpu_and_back(tiny_ckpt, tmp_path):
    """XLA steps and saves; the CPU trainer loads the same weights and AdamW moments bit for bit,
    steps and saves; a fresh XLA trainer loads those bits and its next step matches the CPU
    trainer's next step (1e-5)."""
    xla = trainer(tiny_ckpt, "xla")
    xla.step(make_groups(GROUPS, seed=1))
    cpu = _moved(xla, trainer(tiny_ckpt, "cpu"), tmp_path / "from_xla", version=1)
    cpu.step(make_groups(GROUPS, seed=2))
    back = _moved(cpu, trainer(tiny_ckpt, "xla"), tmp_path / "from_cpu", version=2)
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
