"""train.compute.threads_when_rollouts_idle: the trainer's thread count follows the rollout workers' busy bytes.

The trainer reads the bytes before each decoder layer's attention, forward and backward; these
tests read the thread count torch reports inside the layers the check precedes.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from support.packing_cases import varied_groups
from titanrl.busy_flags import BusyFlags, BusySlot
from titanrl.config import ComputeConfig, DataConfig, MemoryConfig, ModelConfig, RunConfig, TrainConfig
from titanrl.config.parallel import check_idle_threads
from titanrl.config.schema import ParallelConfig
from titanrl.config.validation import validate
from titanrl.errors import ConfigError
from titanrl.models.tiny import write_tiny_checkpoint
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup
from support.sections import merged


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
def flags(tmp_path):
    flags = BusyFlags.create(2, directory=str(tmp_path))
    yield flags
    flags.unlink()


@pytest.fixture(autouse=True)
def _real_thread_setter(monkeypatch):
    """An in-process vLLM engine (the session's, when other tests made it) replaces
    torch.set_num_threads with a no-op in its process; a trainer actor never shares one."""
    engine = sys.modules.get("titanrl.rollout.vllm.engine")
    if engine is not None:
        monkeypatch.setattr(torch, "set_num_threads", engine._original_set_num_threads)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _trainer(checkpoint, flags: BusyFlags | None, **train) -> GRPOTrainer:
    train_config = merged(TrainConfig(compute=ComputeConfig(device="cpu", threads=1, threads_when_rollouts_idle=2)),
                          **train)
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(checkpoint)), train_config, temperature=1.0, seed=0),
                       busy_flags=None if flags is None else flags.path)


def _record_threads(trainer: GRPOTrainer) -> tuple[list[int], list[int]]:
    """Thread counts seen after each layer's attention in the forward (its MLP) and after its
    attention's backward (its input norm's backward)."""
    forward: list[int] = []
    backward: list[int] = []
    for layer in trainer.model.model.layers:
        layer.mlp.register_forward_hook(lambda m, i, o: forward.append(torch.get_num_threads()))
        layer.input_layernorm.register_full_backward_hook(lambda m, gi, go: backward.append(torch.get_num_threads()))
    return forward, backward


def test_busy_flags_track_each_worker(tmp_path):
    flags = BusyFlags.create(3, directory=str(tmp_path))
    assert not flags.any_busy()
    other_process_view = BusySlot.open(flags.path, 2)  # a worker maps the file by path
    with other_process_view:
        assert flags.any_busy()
    assert not flags.any_busy()
    flags.slot(0).set(True)
    flags.slot(1).set(True)
    flags.slot(0).set(False)
    assert flags.any_busy()
    flags.slot(1).set(False)
    assert not flags.any_busy()
    with pytest.raises(IndexError, match="3 workers"):
        flags.slot(3)
    BusySlot.none().set(True)  # records nothing, raises nothing
    assert not flags.any_busy()
    flags.unlink()
    flags.unlink()  # already gone: fine
    assert not (tmp_path / flags.path).exists()


def test_trainer_takes_idle_cores_and_gives_them_back(checkpoint, flags):
    trainer = _trainer(checkpoint, flags)
    forward, backward = _record_threads(trainer)
    layers = len(trainer.model.model.layers)

    flags.slot(1).set(True)  # a worker samples: the trainer keeps train.compute.threads
    trainer.accumulate_gradients(trainer.prepare_batch(varied_groups(seed=0)))
    assert forward and set(forward) == {1} and set(backward) == {1}

    forward.clear(), backward.clear()
    flags.slot(1).set(False)  # every worker waits: all the cores
    trainer.accumulate_gradients(trainer.prepare_batch(varied_groups(seed=0)))
    assert set(forward) == {2} and set(backward) == {2}

    # A worker starting mid-forward gets its core back at the next layer, not the next step.
    forward.clear(), backward.clear()
    trainer.model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: flags.slot(0).set(True))
    trainer.accumulate_gradients(trainer.prepare_batch(varied_groups(seed=0)))
    micro_batches = len(forward) // layers
    assert forward[:layers] == [2] + [1] * (layers - 1)
    assert set(backward) == {1} and micro_batches >= 1


def test_without_busy_flags_the_trainer_keeps_its_threads(checkpoint, flags):
    """Negative control: the same setting, no busy-flags file handed over, nothing switches."""
    trainer = _trainer(checkpoint, None)
    assert trainer.idle_cores is None
    forward, backward = _record_threads(trainer)
    trainer.accumulate_gradients(trainer.prepare_batch(varied_groups(seed=0)))  # flags all idle
    assert set(forward) == {1} and set(backward) == {1}


def test_step_reports_the_idle_fraction(checkpoint, flags):
    trainer = _trainer(checkpoint, flags)
    idle = trainer.step(varied_groups(seed=0))
    assert idle["train/rollouts_idle_frac"] == 1.0
    flags.slot(0).set(True)
    assert trainer.step(varied_groups(seed=1))["train/rollouts_idle_frac"] == 0.0
    assert "train/rollouts_idle_frac" not in _trainer(checkpoint, None).step(varied_groups(seed=0))


def test_checks_run_inside_compiled_blocks(checkpoint, flags):
    """Compiled decoder blocks break the graph at the check: it runs (and counts) every layer,
    forward and backward, instead of being traced once into a constant."""
    torch._dynamo.reset()
    trainer = _trainer(checkpoint, flags, compute=ComputeConfig(compile=True), memory=MemoryConfig(micro_batch_size=64))
    layers = len(trainer.model.model.layers)
    for busy in (False, True, False):
        flags.slot(0).set(busy)
        trainer.idle_cores.checks = trainer.idle_cores.idle_checks = 0
        trainer.accumulate_gradients(trainer.prepare_batch(varied_groups(seed=0)))
        assert trainer.idle_cores.checks == 2 * layers  # one micro-batch: each layer forward and backward
        assert trainer.idle_cores.idle_checks == (0 if busy else 2 * layers)
        assert torch.get_num_threads() == (1 if busy else 2)


@pytest.mark.parametrize(
    "settings, batch_invariant, device, needle",
    [
        (
            dict(compute=ComputeConfig(threads=2, threads_when_rollouts_idle=1)),
            False,
            None,
            "below train.compute.threads=2",
        ),
        (dict(compute=ComputeConfig(threads_when_rollouts_idle=2)), True, None, "batch_invariant"),
        (
            dict(compute=ComputeConfig(threads_when_rollouts_idle=2, device="cuda")),
            False,
            None,
            "train.compute.device='cuda'",
        ),
        (dict(compute=ComputeConfig(threads_when_rollouts_idle=2)), False, "xla", "train.compute.device='xla'"),
        (
            dict(compute=ComputeConfig(threads_when_rollouts_idle=2), parallel=ParallelConfig(dp_shard=2)),
            False,
            None,
            "single-process",
        ),
    ],
)
def test_idle_threads_refuse_what_they_cannot_honour(settings, batch_invariant, device, needle):
    with pytest.raises(ConfigError, match="threads_when_rollouts_idle") as e:
        check_idle_threads(TrainConfig(**settings), batch_invariant, device)
    assert needle in str(e.value)
    unset = dataclasses.replace(settings["compute"], threads_when_rollouts_idle=None)
    check_idle_threads(TrainConfig(**{**settings, "compute": unset}), batch_invariant, device)  # nothing to refuse


def test_run_config_refuses_idle_threads_across_a_cluster(checkpoint, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    config = RunConfig(
        model=ModelConfig(checkpoint=str(checkpoint)),
        data=DataConfig(train_file=str(train)),
        rewards=[lambda prompt, completion, **kw: 0.0],
        train=TrainConfig(compute=ComputeConfig(threads_when_rollouts_idle=2)),
    )
    validate(config)  # the workers on this machine: fine
    with pytest.raises(ConfigError, match="ray_address='127.0.0.1:6379' joins a cluster"):
        validate(dataclasses.replace(config, ray_address="127.0.0.1:6379"))


def test_engine_raises_its_byte_while_it_samples(vllm_engine, flags, monkeypatch):
    """Every engine step of `generate` and of the continuous pump runs with the worker's byte
    raised, and the byte is down once the engine has nothing to sample."""
    import asyncio

    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    seen: list[bool] = []
    llm_engine = vllm_engine.llm.llm_engine
    real_step = llm_engine.step
    monkeypatch.setattr(llm_engine, "step", lambda: (seen.append(flags.any_busy()), real_step())[1])
    vllm_engine.activity = flags.slot(1)
    try:
        vllm_engine.generate([[1, 2, 3]], n=2, max_tokens=4)
        assert seen and all(seen)
        assert not flags.any_busy()

        seen.clear()

        async def main() -> bool:
            async with AsyncGenerator(vllm_engine) as gen:
                await asyncio.gather(*(gen.generate([1, 2, 3], temperature=1.0, max_tokens=4, seed=i)
                                       for i in range(2)))
                await asyncio.sleep(0.05)  # the pump finds nothing pending
                return flags.any_busy()

        assert asyncio.run(main()) is False
        assert seen and all(seen)
        assert not flags.any_busy()
    finally:
        vllm_engine.activity = BusySlot.none()
