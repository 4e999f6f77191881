"""Full training state (GRPOTrainer.save_state / load_state) and HF export from a training checkpoint."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from support.sections import merged

from titanrl.config import (
    ComputeConfig,
    LrScheduleConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)
from titanrl.models.hf_checkpoint import CheckpointError
from titanrl.trainer.checkpoint import export_hf, load_policy
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample

# A run that exercises every piece of state: warm-up + cosine schedule, 2 epochs x 2 minibatches,
# weight decay, and a grad clip small enough to clip.
TRAIN = dict(
    steps=6,
    optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.05),
    lr_schedule=LrScheduleConfig(warmup_steps=2, decay="cosine", min_lr_ratio=0.2),
    ppo_epochs=2,
    minibatches=2,
    memory=MemoryConfig(micro_batch_size=3),
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("state") / "ckpt", seed=7, std=0.1)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    """A tiny untied Llama with biases on q/k/v/o and gate/up/down."""
    from titanrl.models.tiny import tiny_config, write_checkpoint

    config = tiny_config("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    return write_checkpoint(tmp_path_factory.mktemp("state") / "llama", config, seed=7, std=0.1)


def _trainer(path, **overrides) -> GRPOTrainer:
    train = merged(TrainConfig(**TRAIN), **overrides)
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(path)), train, temperature=0.9, seed=0))


def _batches(n: int, seed: int = 0) -> list[list[Group]]:
    """n rollout batches of 3 groups of random token sequences with noisy generator logprobs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        groups = []
        for gid in range(3):
            samples = []
            for r in torch.rand(3, generator=g).tolist():
                p, c = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
                samples.append(Sample(
                    prompt="p", completion="c", prompt_ids=torch.randint(0, 256, (p,), generator=g).tolist(),
                    completion_ids=torch.randint(0, 256, (c,), generator=g).tolist(),
                    gen_logprobs=(-5.5 + torch.rand(c, generator=g)).tolist(), reward=r, group_id=gid,
                    policy_version=0,
                ))
            groups.append(Group(samples))
        out.append(groups)
    return out


def _params(tr):
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _assert_same_params(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _assert_same_optimizer(a: GRPOTrainer, b: GRPOTrainer):
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)


KEYS = ("loss", "grad_norm", "lr", "train/clip_fraction", "train/optimizer_steps", "policy_version")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_resume_continues_bit_for_bit(request, family, tmp_path):
    """Train 2 steps, save_state, train 2 more; a fresh trainer that load_state()s and trains the same
    2 steps ends with bitwise-equal weights and optimizer state, equal schedule and equal metrics.
    qwen3: the tied tiny Qwen3; llama: an untied Llama whose every projection has a bias."""
    ckpt = request.getfixturevalue("ckpt" if family == "qwen3" else f"{family}_ckpt")
    batches = _batches(4)
    a = _trainer(ckpt)
    for groups in batches[:2]:
        a.step(groups)
    a.save_state(str(tmp_path / "state"))
    ref = [a.step(groups) for groups in batches[2:]]

    b = _trainer(ckpt)
    assert b.load_state(str(tmp_path / "state")) == 2
    got = [b.step(groups) for groups in batches[2:]]
    params = _params(a)
    assert any(k.endswith("o_proj.bias") for k in params) == (family == "llama")
    _assert_same_params(params, _params(b))
    _assert_same_optimizer(a, b)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    for r, g in zip(ref, got):
        assert {k: r[k] for k in KEYS} == {k: g[k] for k in KEYS}
    assert ref[-1]["train/clip_fraction"] > 0 and ref[-1]["grad_norm"] > TRAIN["optimizer"].grad_clip  # both exercised


def test_layout_on_disk(ckpt, tmp_path):
    """save_state writes model_optim/ (DCP), trainer_state.pt and hf_config/ (config + tokenizer, no weights)."""
    a = _trainer(ckpt)
    a.step(_batches(1)[0])
    a.save_state(str(tmp_path / "s"))
    assert (tmp_path / "s" / "model_optim" / ".metadata").is_file()
    state = torch.load(tmp_path / "s" / "trainer_state.pt", weights_only=True)
    assert state["version"] == 1 and state["scheduler"]["last_epoch"] == 4
    hf = tmp_path / "s" / "hf_config"
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (hf / "tokenizer.json").is_file() and not list(hf.glob("*.safetensors"))


def test_rng_states_are_restored(ckpt, tmp_path):
    """load_state restores torch, python `random` and numpy global RNGs to their state at save time."""
    a = _trainer(ckpt)
    a.save_state(str(tmp_path / "s"))
    expected = (torch.rand(4), random.random(), np.random.rand(3))
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    _trainer(ckpt).load_state(str(tmp_path / "s"))
    got = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])


def test_save_before_first_step_changes_nothing(ckpt, tmp_path):
    """Saving (and resuming from) a trainer that has not stepped yet leaves AdamW fresh: training then
    matches a trainer that never saved, bit for bit (DCP's get_state_dict would otherwise initialise it)."""
    batches = _batches(2, seed=1)
    plain, saved = _trainer(ckpt), _trainer(ckpt)
    saved.save_state(str(tmp_path / "s0"))
    assert not saved.optimizer.state
    resumed = _trainer(ckpt)
    assert resumed.load_state(str(tmp_path / "s0")) == 0
    for groups in batches:
        plain.step(groups), saved.step(groups), resumed.step(groups)
    _assert_same_params(_params(plain), _params(saved))
    _assert_same_params(_params(plain), _params(resumed))
    _assert_same_optimizer(plain, resumed)


def test_skip_counters_survive_resume(ckpt, tmp_path):
    """A checkpoint taken after a skipped call restores version and skip counters."""
    a = _trainer(ckpt)
    good = _batches(1)[0]
    a.step(good)
    nan = [Group([Sample(prompt="p", completion="c", prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
                         gen_logprobs=[float("nan")] * len(s.completion_ids), reward=s.reward,
                         group_id=s.group_id, policy_version=0) for s in g.samples]) for g in good]
    assert a.step(nan)["train/skipped"] == 1.0
    a.save_state(str(tmp_path / "s"))
    b = _trainer(ckpt)
    assert b.load_state(str(tmp_path / "s")) == 1
    assert (b.skipped_steps, b.consecutive_skipped) == (1, 1)
    m = b.step(good)
    assert m["train/skipped_steps"] == 1.0 and m["train/consecutive_skipped"] == 0.0 and m["policy_version"] == 2.0


def test_policy_rebuilds_without_original_checkpoint(ckpt, tmp_path):
    """load_policy rebuilds the trained weights from the training checkpoint alone, and a trainer whose
    model.checkpoint is a training checkpoint starts from those weights (and load_state()s cleanly)."""
    a = _trainer(ckpt)
    a.step(_batches(1)[0])
    a.save_state(str(tmp_path / "s"))
    model, config = load_policy(tmp_path / "s")
    assert config == a.model_config
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie survives the rebuild
    _assert_same_params(_params(a), {k: v.detach() for k, v in model.state_dict().items()})
    b = _trainer(tmp_path / "s")
    _assert_same_params(_params(a), _params(b))
    assert b.load_state(str(tmp_path / "s")) == 1


def test_export_hf_loads_in_transformers(ckpt, tmp_path):
    """export_hf writes an HF checkpoint that transformers' Qwen3ForCausalLM loads and that gives the
    trainer model's logits bitwise (with MKL's GEMMs, as transformers runs them: oneDNN's round
    differently, see train.compute.cpu_matmul)."""
    from transformers import Qwen3ForCausalLM

    a = _trainer(ckpt, compute=ComputeConfig(cpu_matmul="mkl"))
    a.step(_batches(1)[0])
    a.save_state(str(tmp_path / "s"))
    out = export_hf(tmp_path / "s", tmp_path / "hf")
    assert all((out / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
    hf = Qwen3ForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = a.model(ids)
        theirs = hf(ids).logits
    assert torch.equal(theirs, ours)  # same float32 ops in the same order: bitwise (measured)


def test_load_state_rejects_bad_checkpoints(ckpt, tmp_path):
    """A missing directory, an incomplete one, or a checkpoint of another model gives a CheckpointError
    that names the problem."""
    from titanrl.models.tiny import write_tiny_checkpoint

    tr = _trainer(ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        tr.load_state(str(tmp_path / "nope"))
    (tmp_path / "partial" / "model_optim").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        tr.load_state(str(tmp_path / "partial"))
    other = _trainer(write_tiny_checkpoint(tmp_path / "wide", hidden_size=64, intermediate_size=128))
    other.save_state(str(tmp_path / "wide_state"))
    with pytest.raises(CheckpointError, match="different model"):
        tr.load_state(str(tmp_path / "wide_state"))
