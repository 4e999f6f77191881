"""The trainer actor of train.compute.device='xla' under the XLA venv's interpreter (torch 2.9), with the
driver and the vLLM engine on this venv's torch, and only plain data between them.

The actor starts through the run's own path (`start_trainer` in a real placement group, with
train.compute.device='xla') but trains on torch 2.9's CPU device (`xla_device_type='cpu'`), so its numbers
are comparable with this venv's CPU trainer: same groups, same losses, same pushed weights, and
those weights reach the session's vLLM engine through each transport (broadcast included: its gloo
group joins torch 2.9 and this venv's torch).
Skips, saying why, where .venv-xla is not built (`make xla-venv`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from titanrl.config import ConfigError, ModelConfig, RolloutConfig, RunConfig, TrainConfig  # noqa: E402
from titanrl.config import ComputeConfig, OptimizerConfig
from titanrl.config.xla_env import probe_xla_environment, xla_python  # noqa: E402
from titanrl.models.hf_checkpoint import read_state_dict  # noqa: E402
from titanrl.types import Group, Sample  # noqa: E402
from titanrl.trainer.setup import TrainerSetup

LR = 1e-3
"""Large enough that two steps move every weight measurably."""


def _xla_python_or_skip() -> Path:
    try:
        python = xla_python(TrainConfig(compute=ComputeConfig(device="xla")))
        probe_xla_environment(str(python))
    except ConfigError as e:
        pytest.skip(f"needs the XLA venv: {e}")
    return python


def _actor_facts(trainer) -> dict[str, str]:
    """Runs inside the actor (`__ray_call__`; shipped by value): which interpreter and torch it has."""
    import sys

    import torch

    return {"executable": sys.executable, "torch": torch.__version__, "torch_file": torch.__file__}


def _groups(seed: int) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(2):
        samples = []
        for i in range(4):
            prompt = torch.randint(0, 256, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            completion = torch.randint(0, 256, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            samples.append(Sample("p", "c", prompt, completion, [-3.0] * len(completion), float(i % 3), gid, 0))
        groups.append(Group(samples))
    return groups


@pytest.fixture(scope="module")
def run_config(vllm_tiny_checkpoint) -> RunConfig:
    return RunConfig(model=ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), rollout=RolloutConfig(num_workers=1),
                     train=TrainConfig(compute=ComputeConfig(device="xla"), optimizer=OptimizerConfig(lr=LR)))


@pytest.fixture(scope="module")
def xla_trainer(ray_session, run_config):
    """The XLA trainer actor (on torch 2.9's CPU device), in its run's placement group."""
    from titanrl.config.resolve import resolve
    from titanrl.driver.actors import start_trainer
    from titanrl.driver.placement import Placement

    _xla_python_or_skip()
    placement = Placement.create(run_config)
    actor = start_trainer(resolve(run_config), placement, xla_device_type="cpu")
    try:
        ray_session.get(actor.get_version.remote())
        yield actor
    finally:
        ray_session.kill(actor)
        placement.remove()


@pytest.fixture(scope="module")
def cpu_trainer(run_config):
    """This venv's CPU trainer, built from the same settings as the actor."""
    from titanrl.config.resolve import resolve
    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.trainer.truncation import Truncation

    train = dataclasses.replace(
        resolve(run_config).config.train,
        compute=dataclasses.replace(resolve(run_config).config.train.compute, device="cpu"),
    )
    return GRPOTrainer(
        TrainerSetup(
            run_config.model,
            train,
            run_config.rollout.sampling.temperature,
            run_config.seed,
            truncation=Truncation.scored_by_trainer(run_config.rollout),
        )
    )


def test_actor_runs_under_the_xla_interpreter_and_trains_as_the_cpu_trainer(ray_session, xla_trainer, cpu_trainer,
                                                                           vllm_engine, vllm_tiny_checkpoint):
    """The actor's process is the XLA venv's python with its torch 2.9 (not this venv's); two steps
    on the same groups give the CPU trainer's loss and gradient norm to 1e-5 and the same pushed
    weights (to 1e-6); and a push through the object store, shared memory and the gloo broadcast
    loads exactly the actor's weights into the session's vLLM engine (restored afterwards)."""
    from ray import cloudpickle

    from titanrl.rollout.weight_receiver import WeightReceiver
    from titanrl.weight_sync import make_plan

    ray = ray_session
    venv = _xla_python_or_skip().parent.parent
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        facts = ray.get(xla_trainer.__ray_call__.remote(_actor_facts))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert facts["torch"].startswith("2.9.") and torch.__version__ != facts["torch"]
    assert Path(facts["executable"]).parent.parent == venv
    assert Path(facts["torch_file"]).resolve().is_relative_to(venv.resolve())

    for seed in (0, 1):
        groups = _groups(seed)
        xla_metrics = ray.get(xla_trainer.step.remote(groups))
        cpu_metrics = cpu_trainer.step(groups)
        for key in ("loss", "grad_norm", "train/mismatch_mean_abs"):
            assert xla_metrics[key] == pytest.approx(cpu_metrics[key], abs=1e-5), key
        assert xla_metrics["policy_version"] == cpu_metrics["policy_version"] == seed + 1
    pushed = ray.get(xla_trainer.state_dict_for_push.remote())
    reference = cpu_trainer.state_dict_for_push()
    initial = read_state_dict(vllm_tiny_checkpoint)
    assert set(pushed) == set(reference) == set(initial)
    for name, tensor in pushed.items():
        assert torch.allclose(tensor, reference[name], rtol=0, atol=1e-6), name
    assert all(not torch.equal(pushed[name], initial[name]) for name in initial)  # the steps moved every weight

    receiver = WeightReceiver(vllm_engine)
    try:
        for transport in ("object_store", "shared_memory", "broadcast"):
            plan = make_plan(transport, 1, timeout_s=60)
            opened = xla_trainer.open_weight_sync.remote(plan)
            receiver.open(plan, 1)
            ray.get(opened)
            version = vllm_engine.policy_version + 1
            announcement = xla_trainer.publish_weights.remote(version)
            sent = xla_trainer.send_weights.remote(version)
            assert receiver.receive(ray.get(announcement), version) > 0
            ray.get(sent)
            running = vllm_engine.worker_state_dict()
            assert all(torch.equal(running[name], pushed[name]) for name in pushed), transport
            receiver.close()
            ray.get(xla_trainer.close_weight_sync.remote())
            vllm_engine.update_weights(initial, version=vllm_engine.policy_version + 1)
    finally:
        receiver.close()
        vllm_engine.update_weights(initial, version=vllm_engine.policy_version + 1)
