"""train.compute.device='xla' before any actor starts: what is refused (and how the message says what to do),
the XLA actor's interpreter and env vars, its single bundle, and that nothing crossing the trainer
actor's boundary is a pickled torch object (the XLA trainer runs on another torch version).

None of this needs the XLA venv; tests/test_xla_trainer_actor.py runs the actor itself.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch

from titanrl.config import (
    ComputeConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)
from titanrl.config import KlConfig, validate
from titanrl.config.xla_env import actor_env_vars, actor_pythonpath, has_tpu, validate_xla, xla_python
from titanrl.driver.placement import plan_layout
from titanrl.weight_sync.plain_tensors import PlainTensors
from titanrl.trainer.setup import TrainerSetup


def _reward(prompt: str, completion: str, **fields) -> float:
    return float(len(completion))


@pytest.fixture(scope="module")
def checkpoint(tiny_run):
    return tiny_run.checkpoint


@pytest.fixture
def xla_config(tmp_path, checkpoint) -> RunConfig:
    """A valid config but for train.compute.device='xla' (xla_python: an interpreter that exists)."""
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return RunConfig(
        model=ModelConfig(checkpoint=str(checkpoint)),
        data=DataConfig(train_file=str(train)),
        rewards=[_reward],
        train=TrainConfig(compute=ComputeConfig(device="xla", xla_python=sys.executable)),
    )


def _refused(config: RunConfig, *needles: str, model_config=None) -> str:
    from titanrl.models.hf_checkpoint import read_config

    with pytest.raises(ConfigError) as info:
        validate_xla(config, model_config or read_config(config.model.checkpoint))
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"
    return str(info.value)


def test_xla_refuses_what_it_cannot_run_naming_the_setting(xla_config, monkeypatch):
    """Batch invariance, the KL reference, a mixture-of-experts model, pp / cp / ep, a mesh that is
    neither 1 nor XLA's CPU device count, and an interpreter without torch_xla (here: this venv's
    own python) or none at all each fail in validate, naming the setting to change."""
    from titanrl.models.qwen3.moe import Qwen3MoeConfig
    from titanrl.models.tiny import tiny_config

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)

    def train(**kw):
        return dataclasses.replace(xla_config, train=dataclasses.replace(xla_config.train, **kw))

    _refused(
        dataclasses.replace(xla_config, batch_invariant=True), "batch_invariant=False", "train.compute.device='cpu'"
    )
    _refused(train(kl=KlConfig(coef=0.1)), "train.kl.coef=0")
    moe = Qwen3MoeConfig(**{**dataclasses.asdict(tiny_config()), "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 64})
    _refused(xla_config, "mixture-of-experts", "dense Qwen3", model_config=moe)
    for name in ("pp", "cp", "ep"):
        _refused(train(parallel=ParallelConfig(**{name: 2})), f"train.parallel.{name}=2", "set it to 1")
    if not has_tpu():
        _refused(train(parallel=ParallelConfig(dp_shard=2)), "export CPU_NUM_DEVICES=2")
        monkeypatch.setenv("CPU_NUM_DEVICES", "4")
        _refused(train(parallel=ParallelConfig(dp_shard=2)), "export CPU_NUM_DEVICES=2")
        # A mesh of every device, or of one, passes on to the environment check.
        _refused(train(parallel=ParallelConfig(dp_shard=2, tp=2)), "lacks torch_xla", "make xla-venv")
        _refused(train(parallel=ParallelConfig(dp_replicate=4)), "lacks torch_xla")
    _refused(xla_config, "lacks torch_xla", "make xla-venv", "train.compute.xla_python")
    missing = str(Path(sys.executable).parent / "no-such-python")
    _refused(train(compute=dataclasses.replace(xla_config.train.compute, xla_python=missing)), "train.compute.xla_python=",
             "make xla-venv")
    # validate runs these checks; the same config on the CPU trainer is fine: the refusals are XLA's.
    with pytest.raises(ConfigError, match="lacks torch_xla"):
        validate(xla_config)
    validate(train(compute=ComputeConfig(device="cpu")))


def test_default_interpreter_is_the_venv_in_the_working_directory(tmp_path, monkeypatch):
    """Without train.compute.xla_python, .venv-xla/bin/python of the current directory is taken first."""
    python = tmp_path / ".venv-xla" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    assert xla_python(TrainConfig(compute=ComputeConfig(device="xla"))) == python


def test_actor_env_passes_xla_settings_and_no_foreign_site_packages(monkeypatch):
    """The actor gets the user's PJRT_DEVICE / CPU_NUM_DEVICES / XLA_FLAGS (PJRT_DEVICE=CPU when
    unset and no TPU) and nothing else of the environment; its PYTHONPATH holds the driver's
    working directory and titanrl's checkout but no path of this venv (its torch is another)."""
    env = actor_env_vars({"CPU_NUM_DEVICES": "4", "XLA_FLAGS": "--xla_dump_to=/tmp/x", "HOME": "/root",
                          "PYTHONPATH": "/elsewhere"})
    assert env["CPU_NUM_DEVICES"] == "4" and env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert "HOME" not in env
    if not has_tpu():
        assert env["PJRT_DEVICE"] == "CPU"
    assert actor_env_vars({"PJRT_DEVICE": "TPU"})["PJRT_DEVICE"] == "TPU"
    monkeypatch.syspath_prepend(str(Path(sys.prefix) / "lib" / "extra"))
    entries = actor_pythonpath().split(":")
    assert str(Path.cwd()) in entries
    assert str(Path(__file__).resolve().parents[1]) in entries  # the checkout holding titanrl
    prefix = Path(sys.prefix).resolve()
    assert not [e for e in entries if Path(e).resolve() == prefix or prefix in Path(e).resolve().parents]


def test_xla_trainer_is_one_bundle_whatever_the_mesh():
    """On XLA the parallel degrees are one process's SPMD mesh: one trainer bundle, device 'xla'."""
    config = RunConfig(
        rollout=RolloutConfig(num_workers=2),
        train=TrainConfig(compute=ComputeConfig(device="xla"), parallel=ParallelConfig(dp_shard=2, tp=2)),
    )
    layout = plan_layout(config, 0.0)
    assert (layout.world_size, layout.trainer_device, len(layout.bundles)) == (1, "xla", 3)


class _Globals(pickle.Unpickler):
    """Unpickles while recording the module of every global the pickle names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.modules: set[str] = set()

    def find_class(self, module: str, name: str):
        self.modules.add(module)
        return super().find_class(module, name)


def torch_modules(obj) -> set[str]:
    """The torch modules a Ray-pickled `obj` needs to be rebuilt (empty: plain data)."""
    from ray import cloudpickle

    globals_ = _Globals(cloudpickle.dumps(obj))
    globals_.load()
    return {m for m in globals_.modules if m == "torch" or m.startswith("torch.")}


def test_plain_tensors_pickle_without_torch_and_round_trip_bit_exact():
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).to(torch.bfloat16),
               "i64": torch.arange(6), "strided": torch.randn(6, 4)[:, 1]}
    plain = PlainTensors(tensors)
    assert torch_modules(plain) == set()
    assert torch_modules(tensors) != set()  # the control: a dict of tensors does need torch
    back = pickle.loads(pickle.dumps(plain, protocol=5))
    assert isinstance(back, PlainTensors) and set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_trainer_boundary_carries_no_torch_object(checkpoint, tmp_path):
    """What the driver sends the trainer actor (configs, groups, truncation, plans) and everything
    its methods return (metrics, versions, pushed state dict, object-store announcement, paths)
    pickles without naming a torch module, so a trainer on another torch version can answer."""
    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.trainer.truncation import Truncation
    from titanrl.types import Group, Sample
    from titanrl.weight_sync import make_plan

    model, train = ModelConfig(checkpoint=str(checkpoint)), TrainConfig(compute=ComputeConfig(device="cpu"))
    groups = [Group([Sample("p", "c", [1, 2, 3], [4, 5 + i], [-1.0, -2.0], float(i), g, 0) for i in range(2)])
              for g in range(2)]
    plan = make_plan("object_store", 1)
    sent = [model, train, Truncation(top_k=3), groups, plan]
    trainer = GRPOTrainer(TrainerSetup(model, train, 1.0, 0, truncation=Truncation()))
    trainer.open_weight_sync(plan)
    returned = {
        "step": trainer.step(groups),
        "get_version": trainer.get_version(),
        "state_dict_for_push": trainer.state_dict_for_push(),
        "publish_weights": trainer.publish_weights(1),
        "send_weights": trainer.send_weights(1),
        "save": trainer.save(str(tmp_path / "final")),
    }
    trainer.save_state(str(tmp_path / "state"))
    returned["load_state"] = trainer.load_state(str(tmp_path / "state"))
    assert {k: torch_modules(v) for k, v in returned.items()} == {k: set() for k in returned}
    assert [torch_modules(v) for v in sent] == [set()] * len(sent)
    assert returned["step"]["policy_version"] == 1.0 and returned["load_state"] == 1
