"""SPMD on XLA: `train.parallel` degrees describe one device mesh that the single trainer
process drives; the sharded step computes the unsharded one's loss and gradients."""

import pytest
import torch
import torch_xla

from groups import make_groups
from helpers import host_grads, host_weights, max_diff, trainer
from titanrl.config.schema import ParallelConfig
from titanrl.errors import ConfigError
from titanrl.trainer.setup import TrainerSetup

GROUPS = [[5, 7, 3], [6, 2]]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """The CPU trainer's loss and gradients on GROUPS (the unsharded result)."""
    cpu = trainer(tiny_ckpt, "cpu")
    batch = cpu.prepare_batch(make_groups(GROUPS))
    stats = cpu.accumulate_gradients(batch)
    return batch, stats.loss_sum / stats.tokens, host_grads(cpu)


@pytest.mark.parametrize("parallel", [ParallelConfig(dp_shard=4), ParallelConfig(dp_shard=2, tp=2)],
                         ids=["dp_shard4", "dp_shard2_tp2"])
def test_sharded_step_matches_unsharded(tiny_ckpt, reference, parallel):
    """dp_shard=4, and dp_shard=2 x tp=2, over the four XLA CPU devices of one process (no
    torch.distributed world): weights are sharded on the mesh, and loss and gradients equal the
    unsharded trainer's to 1e-5."""
    batch, loss, grads = reference
    tr = trainer(tiny_ckpt, "xla", parallel)
    weight = tr.model.model.layers[0].mlp.up_proj.weight
    spec = torch_xla._XLAC._get_xla_sharding_spec(weight)
    assert "devices=[" in spec and "replicated" not in spec.split("devices=")[1].split("]")[0], spec
    stats = tr.accumulate_gradients(batch)
    assert abs(stats.loss_sum / stats.tokens - loss) <= 1e-5
    assert max_diff(host_grads(tr), grads) <= 1e-5


def test_mesh_must_cover_the_devices(tiny_ckpt):
    """dp_shard=2 with four XLA devices is refused with what to change (no world of processes
    is asked for); pipeline parallel has no SPMD form here."""
    with pytest.raises(ConfigError, match="torch_xla sees 4 devices"):
        trainer(tiny_ckpt, "xla", ParallelConfig(dp_shard=2))
    with pytest.raises(ConfigError, match="train.parallel.pp=2"):
        trainer(tiny_ckpt, "xla", ParallelConfig(pp=2))


def test_batch_invariant_mode_is_refused(tiny_ckpt):
    """The batch-invariant kernels are CPU/Triton ops: on XLA the trainer refuses the mode."""
    from titanrl.config import ComputeConfig, ModelConfig, TrainConfig
    from titanrl.trainer.trainer import GRPOTrainer

    with pytest.raises(ConfigError, match="batch_invariant=True is not supported with train.compute.device='xla'"):
        GRPOTrainer(
            TrainerSetup(
                ModelConfig(checkpoint=str(tiny_ckpt)),
                TrainConfig(compute=ComputeConfig(device="xla")),
                temperature=1.0,
                seed=0,
                batch_invariant=True,
            )
        )


def test_sharded_steps_and_pushes_compile_nothing_new(tiny_ckpt):
    """A sharded trainer (dp_shard=2 x tp=2) that steps, reads its metrics and hands its weights
    for a push compiles nothing after its first two rounds: a sharded tensor's own `.cpu()`
    compiles a program per call, so each push and stats read used to add one per sharded tensor
    (18 a step on the example). The pushed weights are the trainer's, tile for tile."""
    tr = trainer(tiny_ckpt, "xla", ParallelConfig(dp_shard=2, tp=2))
    def push(version):
        """Both ways weights leave the trainer: a transport's publish (object store) and the full
        state dict for a replacement worker."""
        announced = tr.publish_weights(version).tensors
        tr.send_weights(version)
        return announced, tr.state_dict_for_push()

    for i in range(2):
        tr.step(make_groups(GROUPS, seed=30 + i))
        push(i + 1)
    warm = tr.xla.compile_metrics()["xla/compiles"]
    for i in range(3):
        m = tr.step(make_groups(GROUPS, seed=40 + i))
        announced, pushed = push(i + 3)
        assert m["xla/compiles"] == warm, f"round {i}: {m['xla/compiles'] - warm} new programs"
    assert tr.xla.compile_metrics()["xla/compiles"] == warm
    weights = host_weights(tr)
    for tensors in (announced, pushed):
        assert set(tensors) == set(weights) - {"lm_head.weight"}  # tied: HF files omit the head
        for name, t in tensors.items():
            assert torch.equal(t, weights[name]), name
