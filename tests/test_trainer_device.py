"""`train.compute.device`: the one GRPOTrainer puts the policy, its optimizer state and the batches where
the config says, for world size 1 as for N; weights leave the device once per push."""

import pytest
import torch
from support.sections import merged

from titanrl.config import ComputeConfig, ConfigError, ModelConfig, OptimizerConfig, TrainConfig
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("device") / "ckpt", seed=2, std=0.1)


def _groups() -> list[Group]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for gid, rewards in enumerate([[1.0, 0.0, 0.5], [0.0, 1.0]]):
        samples = []
        for r in rewards:
            prompt = torch.randint(0, 256, (4,), generator=g).tolist()
            completion = torch.randint(0, 256, (5,), generator=g).tolist()
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=[-5.0] * 5, reward=r, group_id=gid, policy_version=0))
        groups.append(Group(samples))
    return groups


def _trainer(ckpt, device: str, **kw) -> GRPOTrainer:
    train = merged(TrainConfig(compute=ComputeConfig(device=device), optimizer=OptimizerConfig(grad_clip=0.5)), **kw)
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), train, temperature=1.0, seed=0))


def test_cpu_device_holds_model_and_optimizer_state_on_cpu(ckpt):
    """device='cpu': parameters, AdamW moments and the pushed weights are CPU tensors."""
    tr = _trainer(ckpt, "cpu")
    tr.step(_groups())
    assert tr.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in tr.model.parameters())
    assert all(v.device.type == "cpu" for s in tr.optimizer.state.values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_config_error(ckpt):
    """device='cuda' where torch sees no GPU fails before any model is loaded, naming train.compute.device."""
    with pytest.raises(ConfigError, match="train.compute.device='cuda'"):
        _trainer(ckpt, "cuda")


def test_auto_picks_the_device_torch_sees(ckpt):
    """device='auto' is CUDA when a GPU is visible, else CPU."""
    tr = _trainer(ckpt, "auto")
    assert tr.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.gpu
def test_cuda_trainer_trains_on_the_gpu_and_matches_cpu(ckpt, tmp_path):
    """device='cuda': the policy and every AdamW moment live on the GPU after a step; loss, grad norm
    and the updated weights match the CPU trainer's (float32, 1e-4); the pushed weights are CPU
    tensors; a saved state resumes on the GPU to the same next step."""
    cpu, gpu = _trainer(ckpt, "cpu"), _trainer(ckpt, "cuda")
    m_cpu, m_gpu = cpu.step(_groups()), gpu.step(_groups())
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    assert all(v.device.type == "cuda" for s in gpu.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    assert m_gpu["loss"] == pytest.approx(m_cpu["loss"], rel=1e-4, abs=1e-6)
    assert m_gpu["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=1e-4)
    pushed_gpu, pushed_cpu = gpu.state_dict_for_push(), cpu.state_dict_for_push()
    assert all(t.device.type == "cpu" for t in pushed_gpu.values())
    for name, t in pushed_cpu.items():
        torch.testing.assert_close(pushed_gpu[name], t, rtol=1e-4, atol=1e-5)
    gpu.save_state(str(tmp_path / "state"))
    resumed = _trainer(ckpt, "cuda")
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.step(_groups())["loss"] == gpu.step(_groups())["loss"]
