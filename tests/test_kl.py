"""KL to the frozen reference policy (train.kl.coef, kl_estimator, kl_in_reward): the estimators
against hand-computed values, the loss term's gradient against autograd on the formula, the
reward penalty's advantages against a hand computation, the reference held only when used,
equal under a sharded layout, and kept across resumes."""

from __future__ import annotations

import gc
import math
import shutil
import statistics

import pytest
import torch

from titanrl.config import (
    ConfigError,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    validate,
)
from titanrl.config import KlConfig
from titanrl.models.hf_checkpoint import CheckpointError, load_model
from titanrl.models.qwen3 import Qwen3ForCausalLM
from titanrl.trainer.batch import PackedBatch
from titanrl.trainer.grpo import token_logprobs
from titanrl.trainer.kl import kl_loss_sum, token_kl
from titanrl.trainer.reference import REFERENCE_STATE_KEY
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample
from titanrl.trainer.setup import TrainerSetup
from support.sections import merged

TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("kl") / "ckpt", seed=7, std=0.1)


def _trainer(path, **train) -> GRPOTrainer:
    train_config = merged(TrainConfig(memory=MemoryConfig(micro_batch_size=3)), **train)
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(path)), train_config, temperature=TEMPERATURE, seed=0))


def _groups(seed: int = 0, equal_rewards: bool = False) -> list[Group]:
    """3 groups of 3 random token sequences with noisy generator logprobs."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(3):
        samples = []
        for r in torch.rand(3, generator=g).tolist():
            p, c = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g))
            samples.append(Sample(
                prompt="p", completion="c", prompt_ids=torch.randint(0, 256, (p,), generator=g).tolist(),
                completion_ids=torch.randint(0, 256, (c,), generator=g).tolist(),
                gen_logprobs=(-5.5 + torch.rand(c, generator=g)).tolist(), reward=0.5 if equal_rewards else r,
                group_id=gid, policy_version=0,
            ))
        groups.append(Group(samples))
    return groups


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    """Moves the policy away from the reference (its initial weights)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * torch.randn(p.shape, generator=g))


def _direct_logprobs(model: Qwen3ForCausalLM, batch: PackedBatch) -> torch.Tensor:
    """Logprobs of the targets from the model's full logits (no chunking, no trimming)."""
    return token_logprobs(model(batch.input_ids_BT), batch.targets_BT, TEMPERATURE)


# ----------------------------------------------------------------------------- estimators


def test_estimators_match_hand_computed_values():
    """With log r = ref - logp = (-0.5, 1.0): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, each
    written out by hand; a masked position is 0 (not NaN) even where its logprob would overflow exp."""
    logp = torch.tensor([[-1.0, -2.0, -1e4]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    want = {
        "k1": [0.5, -1.0, 0.0],
        "k2": [0.125, 0.5, 0.0],
        "k3": [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1, 0.0],
    }
    for name, values in want.items():
        got = token_kl(logp, ref, mask, name)
        torch.testing.assert_close(got, torch.tensor([values]), rtol=0, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="train.kl.estimator 'k4'"):
        token_kl(logp, ref, mask, "k4")


def test_loss_term_gradient_per_token_by_hand():
    """d(kl_coef x sum k)/d logp is kl_coef x (1, logp - ref, 1 - r) for k1, k2, k3 on masked tokens, 0 elsewhere."""
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logp0 = torch.tensor([[-1.0, -2.0, -0.5]])
    r = torch.exp(ref - logp0)
    want = {"k1": torch.ones_like(ref), "k2": logp0 - ref, "k3": 1 - r}
    for name, grad in want.items():
        logp = logp0.clone().requires_grad_()
        sub = PackedBatch(logp0.long(), logp0.long(), mask, logp0, torch.zeros(1), torch.ones(1, dtype=torch.bool),
                          reference_BT=ref)
        kl_loss_sum(logp, sub, TrainConfig(kl=KlConfig(coef=0.3, estimator=name))).backward()
        torch.testing.assert_close(logp.grad, 0.3 * grad * mask, rtol=1e-6, atol=1e-7, msg=name)
    assert kl_loss_sum(logp0, sub, TrainConfig(kl=KlConfig(coef=0.3, in_reward=True))) == 0.0
    assert kl_loss_sum(logp0, sub, TrainConfig()) == 0.0


# ----------------------------------------------------------------------------- in the loss


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_in_loss_gradient_matches_autograd_on_the_formula(ckpt, estimator):
    """With zero advantages (equal rewards) the step's gradient is the KL term's alone: it equals
    autograd through the estimator written out on the policy's full-logit logprobs, the reference
    logprobs being a fresh model's of the initial checkpoint."""
    coef = 0.7
    tr = _trainer(ckpt, kl=KlConfig(coef=coef, estimator=estimator))
    _perturb(tr.model)
    batch = tr.prepare_batch(_groups(equal_rewards=True))
    assert not batch.advantages_B.any()
    reference, _ = load_model(ckpt)
    with torch.no_grad():
        ref = _direct_logprobs(reference, batch)
    mask = batch.loss_mask_BT
    torch.testing.assert_close(batch.reference_BT * mask, ref * mask, rtol=0, atol=1e-5)

    stats = tr.accumulate_gradients(batch)
    got = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    tr.model.zero_grad(set_to_none=True)
    logp = _direct_logprobs(tr.model, batch)
    log_r = (ref - logp) * mask
    per_token = {"k1": -log_r, "k2": log_r ** 2 / 2, "k3": torch.exp(log_r) - 1 - log_r}[estimator]
    loss = coef * (per_token * mask).sum() / mask.sum()
    loss.backward()
    assert stats.loss_sum / stats.tokens == pytest.approx(loss.item(), rel=1e-4)
    assert loss.item() != 0.0
    for name, p in tr.model.named_parameters():
        # Chunked vs full-logit head, another summation order: equal on the gradient's own scale.
        assert (got[name] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name
        assert p.grad.abs().sum() > 0, name  # the KL term alone moves every parameter


def test_reference_held_only_with_kl(ckpt):
    """kl_coef=0: no reference (one model in memory, no reference forward, no kl/ metrics). kl_coef > 0:
    a second, frozen model whose logprobs at the start equal the policy's bit for bit."""
    def models() -> int:
        gc.collect()
        return sum(type(o) is Qwen3ForCausalLM for o in gc.get_objects())

    before = models()
    off = _trainer(ckpt)
    assert off.reference is None and models() == before + 1
    batch = off.prepare_batch(_groups())
    assert batch.reference_BT is None
    assert not [k for k in off.step(_groups()) if k.startswith("kl/")]
    del off, batch

    on = _trainer(ckpt, kl=KlConfig(coef=0.1))
    assert models() == before + 2
    ref_params = list(on.reference.pm.parts[0].parameters())
    assert ref_params and not any(p.requires_grad for p in ref_params)
    assert not on.reference.pm.parts[0].training
    batch = on.prepare_batch(_groups())
    assert torch.equal(batch.reference_BT, on.proximal_logprobs(batch))  # same weights, same forward path
    metrics = on.step(_groups())
    assert {"kl/mean", "kl/max"} <= metrics.keys() and "kl/reward_penalty" not in metrics
    # The policy moved, the reference did not.
    assert all(torch.equal(a, b) for a, b in zip(ref_params, load_model(ckpt)[0].parameters(), strict=True))


# ----------------------------------------------------------------------------- in the reward


def test_in_reward_advantages_and_metrics_by_hand(ckpt):
    """kl_in_reward: each sample's reward loses kl_coef x sum over its completion of k1 = gen - ref,
    then GRPO's (r - mean) / (std + 1e-6) per group, all computed here by hand from the samples and a
    fresh reference model; kl/mean, kl/max and kl/reward_penalty are the same numbers' summaries."""
    coef = 0.05
    groups = _groups(seed=3)
    tr = _trainer(ckpt, kl=KlConfig(coef=coef, estimator="k1", in_reward=True))
    _perturb(tr.model)  # the penalty reads the generator's logprobs, not the policy's
    batch = tr.prepare_batch(groups)
    reference, _ = load_model(ckpt)
    want_adv, token_kls, penalties = [], [], []
    for group in groups:
        rewards = []
        for s in group.samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            with torch.no_grad():
                lp = torch.log_softmax(reference(ids[:, :-1])[0].float() / TEMPERATURE, -1)
            p = len(s.prompt_ids)
            ref = [lp[p - 1 + i, t].item() for i, t in enumerate(s.completion_ids)]
            kls = [g - r for g, r in zip(s.gen_logprobs, ref, strict=True)]
            token_kls += kls
            penalties.append(coef * sum(kls))
            rewards.append(s.reward - coef * sum(kls))
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        want_adv += [(r - mean) / (std + 1e-6) for r in rewards]
    torch.testing.assert_close(batch.advantages_B, torch.tensor(want_adv), rtol=1e-4, atol=1e-5)
    plain = _trainer(ckpt).prepare_batch(groups).advantages_B
    assert (batch.advantages_B - plain).abs().max() > 0.05  # the penalty changed them

    metrics = tr.step(groups)
    assert metrics["kl/mean"] == pytest.approx(statistics.fmean(token_kls), rel=1e-4)
    assert metrics["kl/max"] == pytest.approx(max(token_kls), rel=1e-4)
    assert metrics["kl/reward_penalty"] == pytest.approx(statistics.fmean(penalties), rel=1e-4)


# ----------------------------------------------------------------------------- resume, layouts


def test_resume_keeps_the_reference(ckpt, tmp_path):
    """The training state records the reference's checkpoint; a trainer started from the training
    checkpoint (whose own weights have moved) and a trainer that load_state()s both hold the initial
    weights as reference and continue bit for bit; a recorded reference that is gone fails naming it."""
    initial = tmp_path / "initial"
    shutil.copytree(ckpt, initial)
    a = _trainer(initial, kl=KlConfig(coef=0.2), optimizer=OptimizerConfig(lr=1e-2))
    for seed in (0, 1):
        a.step(_groups(seed))
    a.save_state(str(tmp_path / "s"))
    state = torch.load(tmp_path / "s" / "trainer_state.pt", weights_only=True)
    assert state[REFERENCE_STATE_KEY] == str(initial.absolute())
    batch = a.prepare_batch(_groups(2))
    assert not torch.equal(batch.reference_BT, a.proximal_logprobs(batch))  # the policy moved

    from_state = _trainer(tmp_path / "s", kl=KlConfig(coef=0.2), optimizer=OptimizerConfig(lr=1e-2))
    loaded = _trainer(tmp_path / "s", kl=KlConfig(coef=0.2), optimizer=OptimizerConfig(lr=1e-2))
    assert loaded.load_state(str(tmp_path / "s")) == 2
    for b in (from_state, loaded):
        assert b.reference.checkpoint == str(initial.absolute())
        assert torch.equal(b.prepare_batch(_groups(2)).reference_BT, batch.reference_BT)
    want = a.step(_groups(2))
    got = loaded.step(_groups(2))
    assert {k: got[k] for k in ("loss", "grad_norm", "kl/mean")} == {k: want[k] for k in ("loss", "grad_norm", "kl/mean")}

    shutil.rmtree(initial)
    gone = rf"reference policy's checkpoint '{initial}' \(recorded in {tmp_path / 's'}/trainer_state.pt\) does not exist"
    with pytest.raises(CheckpointError, match=gone):
        _trainer(ckpt, kl=KlConfig(coef=0.2)).load_state(str(tmp_path / "s"))
    with pytest.raises(CheckpointError, match=gone):
        _trainer(tmp_path / "s", kl=KlConfig(coef=0.2))


def test_sharded_reference_equals_one_process(ckpt, tmp_path, gloo_world):
    """dp_shard=2 (batch-invariant), and a dp_shard=2 trainer resuming a one-process run's training
    checkpoint (another layout), hold the same reference: its logprobs equal the one-process ones
    bit for bit, as do kl/mean and kl/max of a step, whose loss (KL term included) matches; cp=2
    (each rank half of every sequence) and tp=2 give them to float error."""
    from kl_worlds import reference_in_layout

    inv = dict(kl=KlConfig(coef=0.2), memory=MemoryConfig(micro_batch_size=2), batch_invariant=True)
    plain = dict(kl=KlConfig(coef=0.2), memory=MemoryConfig(micro_batch_size=2))
    one = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), TrainConfig(**plain), TEMPERATURE, seed=0))
    for seed in (0, 1):
        one.step(_groups(seed))
    one.save_state(str(tmp_path / "s"))
    groups = _groups(2)
    runs = {"dp_shard": (str(ckpt), dict(dp_shard=2), inv, True),
            "resumed": (str(tmp_path / "s"), dict(dp_shard=2), inv, False),
            "cp": (str(ckpt), dict(cp=2), plain, False),
            "tp": (str(ckpt), dict(tp=2), plain, False)}
    got = gloo_world.run(reference_in_layout, runs, groups, TEMPERATURE, timeout_s=300)[0]
    single = GRPOTrainer(
        TrainerSetup(ModelConfig(checkpoint=str(ckpt)), TrainConfig(**plain), TEMPERATURE, seed=0, batch_invariant=True)
    )
    want_ref = single.prepare_batch(groups).reference_BT
    assert want_ref.abs().sum() > 0
    want = single.step(groups)
    for name in ("dp_shard", "resumed"):
        assert torch.equal(got[name]["reference_BT"], want_ref), name
    assert got["resumed"]["version"] == 2
    metrics = got["dp_shard"]["metrics"]
    assert (metrics["kl/mean"], metrics["kl/max"]) == (want["kl/mean"], want["kl/max"])
    assert metrics["loss"] == pytest.approx(want["loss"], rel=1e-5)
    for name in ("cp", "tp"):
        torch.testing.assert_close(got[name]["reference_BT"], want_ref, rtol=0, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------- validation


def _run_config(tmp_path, checkpoint, **train) -> RunConfig:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    return RunConfig(model=ModelConfig(checkpoint=str(checkpoint)), data=DataConfig(train_file=str(data)),
                     train=TrainConfig(**train), rewards=[lambda prompt, completion, **kw: 0.0])


def test_validation_names_the_field(ckpt, tmp_path):
    validate(_run_config(tmp_path, ckpt, kl=KlConfig(coef=0.1, estimator="k2", in_reward=True)))
    validate(_run_config(tmp_path, ckpt, kl=KlConfig(coef=0.1), parallel=ParallelConfig(dp_shard=2)))
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"train\.kl\.coef must be a finite number >= 0"):
            validate(_run_config(tmp_path, ckpt, kl=KlConfig(coef=bad)))
    with pytest.raises(ConfigError, match=r"train\.kl\.estimator must be 'k1', 'k2' or 'k3', got str 'k4'"):
        validate(_run_config(tmp_path, ckpt, kl=KlConfig(coef=0.1, estimator="k4")))
    with pytest.raises(ConfigError, match=r"train\.kl\.coef > 0 is not implemented for the pipelined trainer "
                                          r"\(train\.parallel\.pp=2\)"):
        validate(_run_config(tmp_path, ckpt, kl=KlConfig(coef=0.1), parallel=ParallelConfig(pp=2)))
    validate(_run_config(tmp_path, ckpt, parallel=ParallelConfig(pp=2)))  # no KL: pipelines are fine
