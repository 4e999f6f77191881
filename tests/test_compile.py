"""train.compute.compile: decoder blocks through torch.compile give the eager trainer's gradients.

Inductor fuses the elementwise chains and reorders their float32 arithmetic, so the comparison
is to 1e-5, not bitwise (batch-invariant mode, the bitwise path, refuses compile).
"""

from __future__ import annotations

import pytest
import torch

from support.packing_cases import accumulated_gradients, assert_same_gradients, varied_groups
from support.sections import merged
from titanrl.config import ComputeConfig, ModelConfig, TrainConfig
from titanrl.config.parallel import check_compile
from titanrl.config.schema import ParallelConfig
from titanrl.errors import ConfigError
from titanrl.models.tiny import write_tiny_checkpoint, write_tiny_moe_checkpoint
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_compiled_blocks_give_eager_gradients(tmp_path, moe):
    write = write_tiny_moe_checkpoint if moe else write_tiny_checkpoint
    ckpt = write(tmp_path / "tiny", seed=1)
    groups = varied_groups(seed=3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, eager_stats, eager_lp, _, _ = accumulated_gradients(ckpt, groups, pack=True)
    assert _compiled_graphs() == 0
    compiled, stats, lp, _, _ = accumulated_gradients(ckpt, groups, pack=True, compute=ComputeConfig(compile=True))
    assert _compiled_graphs() > 0, "train.compute.compile=True compiled nothing"
    assert_same_gradients(compiled, eager, atol=1e-5)
    torch.testing.assert_close(lp, eager_lp, rtol=0, atol=1e-5)
    assert stats.loss_sum == pytest.approx(eager_stats.loss_sum, abs=1e-5)


def test_compiled_trainer_reuses_one_graph_across_lengths(tmp_path):
    """Packed micro-batches of other lengths reuse the symbolic-size graph: no compile per step."""
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    trainer = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=str(ckpt)),
            TrainConfig(compute=ComputeConfig(device="cpu", compile=True)),
            temperature=1.0,
            seed=0,
        )
    )
    trainer.step(varied_groups(seed=0))
    after_first = _compiled_graphs()
    for seed in (1, 2):
        trainer.step(varied_groups(seed=seed))
    assert after_first > 0
    assert _compiled_graphs() == after_first


@pytest.mark.parametrize("settings, batch_invariant, device, needle", [
    (dict(), True, None, "batch_invariant"),
    (dict(compute=ComputeConfig(device="xla")), False, None, "train.compute.device='xla'"),
    (dict(), False, "xla", "train.compute.device='xla'"),
    (dict(parallel=ParallelConfig(dp_shard=2)), False, None, "dp_shard=2"),
    (dict(parallel=ParallelConfig(tp=2, pp=2)), False, None, "tp=2, pp=2"),
])
def test_compile_refuses_what_it_cannot_honour(settings, batch_invariant, device, needle):
    with pytest.raises(ConfigError, match="train.compute.compile=True") as e:
        check_compile(merged(TrainConfig(compute=ComputeConfig(compile=True)), **settings), batch_invariant, device)
    assert needle in str(e.value)
    check_compile(TrainConfig(**settings), batch_invariant, device)  # compile off (default): nothing to refuse


def test_trainer_refuses_compile_with_batch_invariance(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    with pytest.raises(ConfigError, match="batch_invariant"):
        GRPOTrainer(
            TrainerSetup(
                ModelConfig(checkpoint=str(ckpt)),
                TrainConfig(compute=ComputeConfig(device="cpu", compile=True)),
                temperature=1.0,
                seed=0,
                batch_invariant=True,
            )
        )


def test_compiled_blocks_take_the_thread_count_at_run_time(tmp_path, monkeypatch):
    """A block compiled while the trainer runs 1 thread still gets OpenMP regions, sized when they
    run (train.compute.threads_when_rollouts_idle raises the count later); Inductor's default would emit
    none and stay single-threaded."""
    from torch._inductor.utils import run_and_get_code

    from titanrl.trainer.parallel import compile as compile_module

    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        counts = {}
        for dynamic in (True, False):  # False: the negative control, Inductor's default
            monkeypatch.setattr(compile_module, "INDUCTOR_OPTIONS", {"cpp.dynamic_threads": dynamic})
            torch._dynamo.reset()
            trainer = GRPOTrainer(
                TrainerSetup(
                    ModelConfig(checkpoint=str(ckpt)),
                    TrainConfig(compute=ComputeConfig(device="cpu", compile=True, threads=1)),
                    temperature=1.0,
                    seed=0,
                )
            )
            batch = trainer.prepare_batch(varied_groups(seed=0))
            _, code = run_and_get_code(trainer.accumulate_gradients, batch)
            counts[dynamic] = "\n".join(code).count("#pragma omp parallel")
    finally:
        torch.set_num_threads(threads)
    assert counts[True] > 0, "the compiled block has no OpenMP region"
    assert counts[False] == 0, counts  # the control: compiled at 1 thread, serial for good
