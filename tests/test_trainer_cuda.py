"""The trainer's newer paths on a CUDA GPU: packed micro-batches (torch's varlen flash kernel in
bfloat16, the padded-SDPA fallback in float32), compiled decoder blocks, and the MoE policy.

Each test compares against the same step on the CPU or against the padded/eager step on the
GPU, gradient by gradient. All are marked `gpu`: they skip where torch sees no CUDA device.
"""

from __future__ import annotations

import functools

import pytest
import torch

from support.packing_cases import accumulated_gradients, assert_same_gradients, varied_groups
from titanrl.models import packed_sequences
from titanrl.models.tiny import write_tiny_checkpoint, write_tiny_moe_checkpoint
from titanrl.config import ComputeConfig, MoeConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_cuda"), seed=0)


def _assert_close_to_cpu(gpu: dict, cpu: dict) -> None:
    """float32 GPU against CPU: other reduction orders, so an absolute floor for near-zero entries."""
    assert_same_gradients(gpu, cpu, atol=1e-6)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared_prompts"])
def test_cuda_packed_float32_step_has_the_cpu_padded_gradients(checkpoint, share):
    """float32 on the GPU: packed (padded SDPA around the call) equals the CPU's padded step."""
    groups = varied_groups()
    g_cpu, s_cpu, lp_cpu, *_ = accumulated_gradients(checkpoint, groups, False)
    g_gpu, s_gpu, lp_gpu, computed, _ = accumulated_gradients(
        checkpoint, groups, True, share=share, compute=ComputeConfig(device="cuda")
    )
    _assert_close_to_cpu(g_gpu, g_cpu)
    torch.testing.assert_close(lp_gpu, lp_cpu, rtol=0, atol=1e-5)
    assert s_gpu.tokens == s_cpu.tokens


def test_cuda_bfloat16_packed_step_runs_the_varlen_flash_kernel(checkpoint, monkeypatch):
    """bfloat16 on the GPU with packing (prompts not shared): every attention call goes through
    torch's varlen flash kernel, and the gradients stay within bfloat16 error of the padded step."""
    real = packed_sequences._varlen_kernel()
    assert real is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    calls = []

    @functools.wraps(real)  # keeps the signature the trainer reads its options from
    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_sequences, "_varlen_kernel", lambda: counting)
    groups = varied_groups()
    g_pack, _, lp_pack, *_ = accumulated_gradients(
        checkpoint, groups, True, share=False, compute=ComputeConfig(device="cuda"), dtype="bfloat16"
    )
    assert calls, "the packed bfloat16 step never called the varlen kernel"
    monkeypatch.undo()
    g_pad, _, lp_pad, *_ = accumulated_gradients(
        checkpoint, groups, False, compute=ComputeConfig(device="cuda"), dtype="bfloat16"
    )
    g_ref, _, lp_ref, *_ = accumulated_gradients(checkpoint, groups, False)  # float32 CPU, the reference
    assert g_pack.keys() == g_ref.keys()
    for name in g_ref:
        # The packed bf16 step is no further from float32 than the padded bf16 step (plus slack).
        err_pack, err_pad = _relative_error(g_pack[name], g_ref[name]), _relative_error(g_pad[name], g_ref[name])
        assert err_pack <= max(2 * err_pad, 0.05), (name, err_pack, err_pad)
    mask = lp_ref != 0
    assert (lp_pack[mask] - lp_ref[mask]).abs().max() < 0.1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cuda_compiled_blocks_give_eager_gradients(tmp_path, moe):
    """train.compute.compile on the GPU (Inductor's Triton kernels): gradients and logprobs of eager."""
    ckpt = (write_tiny_moe_checkpoint if moe else write_tiny_checkpoint)(tmp_path / "tiny", seed=1)
    groups = varied_groups(seed=3)
    torch._dynamo.reset()
    eager, _, eager_lp, *_ = accumulated_gradients(ckpt, groups, True, compute=ComputeConfig(device="cuda"))
    compiled, _, lp, *_ = accumulated_gradients(ckpt, groups, True, compute=ComputeConfig(device="cuda", compile=True))
    assert_same_gradients(compiled, eager, atol=1e-5)
    torch.testing.assert_close(lp, eager_lp, rtol=0, atol=1e-5)


def test_cuda_moe_step_with_router_replay_matches_cpu(tmp_path):
    """The MoE policy (router replay, auxiliary loss) on the GPU: the CPU's gradients and aux loss."""
    ckpt = write_tiny_moe_checkpoint(tmp_path / "moe", seed=0)
    groups = varied_groups(seed=2, routed_layers=2)
    kw = dict(moe=MoeConfig(router_replay=True, load_balance="aux_loss"))
    g_cpu, s_cpu, *_ = accumulated_gradients(ckpt, groups, True, **kw)
    g_gpu, s_gpu, *_ = accumulated_gradients(ckpt, groups, True, compute=ComputeConfig(device="cuda"), **kw)
    _assert_close_to_cpu(g_gpu, g_cpu)
    assert s_gpu.moe.aux_loss == pytest.approx(s_cpu.moe.aux_loss, rel=1e-5)
