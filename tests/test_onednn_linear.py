"""train.compute.cpu_matmul='onednn': the CPU trainer's linear layers through oneDNN give MKL's results.

oneDNN sums in another order than MKL, so values are compared to float32 rounding (1e-5), not
bit for bit; batch-invariant mode never takes this path (it is refused there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support.packing_cases import accumulated_gradients, assert_same_gradients, varied_groups
from titanrl.config import ComputeConfig, ConfigError, ModelConfig, TrainConfig
from titanrl.config.parallel import uses_onednn_linears
from titanrl.config.schema import ParallelConfig
from titanrl.kernels.onednn_linear import (
    OneDnnLinear,
    apply_onednn_linears,
    onednn_available,
    onednn_is_faster_here,
    onednn_matmul_nt,
)
from titanrl.models.tiny import write_tiny_checkpoint, write_tiny_moe_checkpoint
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup
from support.sections import merged

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 37])
def test_op_forward_and_gradients_match_mkl(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3, 48, generator=gen, requires_grad=True)
    w = torch.randn(80, 48, generator=gen, requires_grad=True)
    grad = torch.randn(rows, 3, 80, generator=gen)
    ours = onednn_matmul_nt(x.reshape(-1, 48), w).view(rows, 3, 80)
    x_grad, w_grad = torch.autograd.grad(ours, (x, w), grad)
    expected = F.linear(x, w)
    x_ref, w_ref = torch.autograd.grad(expected, (x, w), grad)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_grad, x_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_grad, w_ref, rtol=1e-5, atol=1e-5)


def test_apply_swaps_plain_linears_only_and_keeps_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4, bias=False)), nn.LayerNorm(4))
    params = dict(model.named_parameters())
    assert apply_onednn_linears(model) == 2
    assert [type(m) for m in model.modules()].count(OneDnnLinear) == 2
    assert dict(model.named_parameters()) == params  # same names, same Parameter objects
    x = torch.randn(5, 8)
    expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1][0].weight)
    torch.testing.assert_close(model[1](model[0](x)), expected, rtol=1e-5, atol=1e-6)


def _trainer(ckpt, **train) -> GRPOTrainer:
    train_config = merged(TrainConfig(compute=ComputeConfig(device="cpu")), **train)
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), train_config, temperature=1.0, seed=0))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_trainer_with_onednn_has_the_mkl_gradients(tmp_path, moe):
    """The trainer's linears become OneDnnLinear (and stay nn.Linear with 'mkl'), and a step's
    gradients of every parameter and its logprobs match MKL's."""
    ckpt = (write_tiny_moe_checkpoint if moe else write_tiny_checkpoint)(tmp_path / "tiny", seed=1)
    layer = _trainer(ckpt, compute=ComputeConfig(cpu_matmul="onednn")).model.model.layers[0]
    assert type(layer.self_attn.q_proj) is OneDnnLinear
    assert (
        type(_trainer(ckpt, compute=ComputeConfig(cpu_matmul="mkl")).model.model.layers[0].self_attn.q_proj)
        is nn.Linear
    )
    groups = varied_groups(seed=3)
    mkl, mkl_stats, mkl_lp, *_ = accumulated_gradients(ckpt, groups, pack=True, compute=ComputeConfig(cpu_matmul="mkl"))
    ours, stats, lp, *_ = accumulated_gradients(ckpt, groups, pack=True, compute=ComputeConfig(cpu_matmul="onednn"))
    assert_same_gradients(ours, mkl, atol=1e-6)
    torch.testing.assert_close(lp, mkl_lp, rtol=0, atol=1e-5)
    assert stats.loss_sum == pytest.approx(mkl_stats.loss_sum, rel=1e-6)


def test_compiled_blocks_with_onednn_have_the_eager_mkl_gradients(tmp_path):
    """oneDNN's op runs inside train.compute.compile's blocks (a custom op with a fake kernel)."""
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    groups = varied_groups(seed=4)
    torch._dynamo.reset()
    eager, *_ = accumulated_gradients(ckpt, groups, pack=True, compute=ComputeConfig(cpu_matmul="mkl"))
    compiled, *_ = accumulated_gradients(
        ckpt, groups, pack=True, compute=ComputeConfig(cpu_matmul="onednn", compile=True)
    )
    assert_same_gradients(compiled, eager, atol=1e-5)


@pytest.mark.parametrize("settings, batch_invariant, device, dtype, needle", [
    (dict(), True, "cpu", "float32", "batch_invariant"),
    (dict(), False, "cuda", "float32", "train.compute.device='cuda'"),
    (dict(parallel=ParallelConfig(dp_shard=2)), False, "cpu", "float32", "single-process"),
    (dict(), False, "cpu", "bfloat16", "bfloat16"),
])
def test_explicit_onednn_refuses_what_it_cannot_honour_and_auto_falls_back(settings, batch_invariant, device,
                                                                            dtype, needle):
    with pytest.raises(ConfigError, match="train.compute.cpu_matmul='onednn'") as e:
        uses_onednn_linears(merged(TrainConfig(compute=ComputeConfig(cpu_matmul="onednn")), **settings),
                            batch_invariant, device, dtype)
    assert needle in str(e.value)
    auto = merged(TrainConfig(compute=ComputeConfig(cpu_matmul="auto")), **settings)
    assert not uses_onednn_linears(auto, batch_invariant, device, dtype)


def test_auto_picks_onednn_only_where_it_was_measured_faster():
    assert uses_onednn_linears(TrainConfig(), False, "cpu", "float32") == onednn_is_faster_here()
    assert not uses_onednn_linears(TrainConfig(compute=ComputeConfig(cpu_matmul="mkl")), False, "cpu", "float32")
    assert uses_onednn_linears(TrainConfig(compute=ComputeConfig(cpu_matmul="onednn")), False, "cpu", "float32")
