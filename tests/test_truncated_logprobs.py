"""Truncated sampling done right: the trainer scores tokens under the generator's top-k / top-p
truncated, renormalised distribution (rollout.sampling.logprobs='sampled'), or both sides under the full
softmax (rollout.sampling.logprobs='raw'), so at equal weights the PPO ratio is 1, not the nucleus mass."""

from __future__ import annotations

import math

import pytest
import torch

from titanrl.config import ModelConfig, SamplingConfig, TrainConfig
from titanrl.trainer.batch import pack
from titanrl.trainer.chunked_logprobs import chunked_token_logprobs
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.truncation import Truncation, kept_mask
from titanrl.types import Group, Sample

CASES = [Truncation(top_p=0.9), Truncation(top_k=20), Truncation(top_k=5, top_p=0.8), Truncation(top_p=0.05),
         Truncation(top_k=1), Truncation(top_k=400)]
"""top-p alone, top-k alone, both, a nucleus of one token, greedy top-k, and top-k past the vocabulary (off)."""


def _logits_with_ties(rows: int, V: int, seed: int) -> torch.Tensor:
    """Random logits rounded to bfloat16 (as a bf16 model's are): many exact ties, also at the boundary."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=gen) * 3).bfloat16().float()


@pytest.mark.parametrize("truncation", CASES, ids=str)
def test_kept_set_is_vllms(truncation):
    """`kept_mask` keeps exactly the tokens vLLM's CPU sampler keeps (its own apply_top_k_top_p on
    the same float32 logits leaves them finite), ties included; a row's set is the same alone and
    inside a batch of 37."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    z = _logits_with_ties(37, 259, seed=1)
    k = None if truncation.top_k == 0 else torch.full((37,), truncation.top_k, dtype=torch.int32)
    p = None if truncation.top_p == 1 else torch.full((37,), truncation.top_p, dtype=torch.float32)
    if k is not None and truncation.top_k >= z.shape[1]:
        k = None  # vLLM's input batch passes no top-k for top_k >= vocabulary
    theirs = torch.isfinite(apply_top_k_top_p(z.clone(), k, p))
    ours = kept_mask(z, truncation)
    assert torch.equal(ours, theirs)
    assert torch.equal(kept_mask(z[11:12], truncation), ours[11:12])
    assert ours.sum(-1).min() >= 1


def _toy(dtype: torch.dtype, ties: bool = False):
    gen = torch.Generator().manual_seed(0)
    N, D, V = 30, 16, 64
    hidden = torch.randn(N, D, generator=gen, dtype=dtype)
    weight = torch.randn(V, D, generator=gen, dtype=dtype)
    if ties:  # token pairs with equal head rows: every logit value appears twice
        weight[1::2] = weight[::2]
    targets = torch.randint(0, V, (N,), generator=gen)
    g_lp, g_ent = torch.randn(N, generator=gen, dtype=dtype), torch.randn(N, generator=gen, dtype=dtype)
    return hidden, weight, targets, g_lp, g_ent


def _reference(h, w, targets, T, truncation):
    """Full logits, vLLM's kept set (+ the target), masked log_softmax: autograd does the rest."""
    z = (h @ w.t()) / T
    kept = kept_mask(z.detach(), truncation)
    outside = ~kept.gather(-1, targets[:, None]).squeeze(-1)
    kept[torch.arange(len(targets)), targets] = True
    logp = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1)
    entropy = -(logp.exp() * logp.masked_fill(~kept, 0.0)).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy, outside


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("truncation", [Truncation(top_p=0.9), Truncation(top_k=6), Truncation(top_k=8, top_p=0.7)],
                         ids=str)
def test_truncated_logprobs_and_gradients_equal_a_direct_reference(dtype, truncation, ties):
    """Chunked truncated logprobs, entropies and the gradients of hidden states and head weight
    (from both outputs) equal the direct reference's (full logits, mask, log_softmax) to 1e-6
    relative in float32 (1e-12 in float64) at temperature 0.7 and chunk sizes 7 and 30; targets
    outside the kept set are flagged and scored over kept + {target} (finite). With tied logits
    the top-p sort splits some ties at the boundary (the backward's rebuilt kept set must too)."""
    hidden, weight, targets, g_lp, g_ent = _toy(dtype, ties)
    T, tol = 0.7, 1e-6 if dtype == torch.float32 else 1e-12

    def grads(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent, outside = fn(h, w)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp.detach(), ent.detach(), outside, h.grad, w.grad

    ref = grads(lambda h, w: _reference(h, w, targets, T, truncation))
    assert ref[2].any() and not ref[2].all(), "the toy must have targets inside and outside the kept set"
    if ties and truncation.top_p < 1:
        z = (hidden @ weight.t()) / T
        kept = kept_mask(z, truncation)
        low = z.masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
        assert ((z == low) & ~kept).any(), "some row's boundary ties must be split"
    for chunk in (7, 30):
        def chunked(h, w):
            outside = torch.zeros(len(targets), dtype=torch.bool)
            lp, ent = chunked_token_logprobs(h, w, targets, T, chunk, truncation=truncation, outside_N=outside)
            return lp, ent, outside

        got = grads(chunked)
        assert torch.equal(got[2], ref[2])
        assert torch.isfinite(got[0]).all()
        for a, b in zip(got[:2] + got[3:], ref[:2] + ref[3:]):
            assert ((a - b).norm() / b.norm()).item() <= tol
    # Negative control: the untruncated head differs (the reference really is truncated).
    full = chunked_token_logprobs(hidden, weight, targets, T, 7)[0]
    assert (full - ref[0]).abs().max() > 1e-2


def test_truncation_off_is_the_full_softmax():
    """An inactive Truncation (top_k 0, top_p 1) leaves the head's bits unchanged."""
    hidden, weight, targets, _, _ = _toy(torch.float32)
    a = chunked_token_logprobs(hidden, weight, targets, 0.7, 7)
    b = chunked_token_logprobs(hidden, weight, targets, 0.7, 7, truncation=Truncation())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- against the real vLLM engine (the session's, processed logprobs) ------------------------------
PROMPTS = ["12+34=", "hello world", "the quick brown fox", "9*9="]


def _groups(engine, temperature: float, **sampling) -> list[Group]:
    outputs = engine.generate(PROMPTS, n=4, temperature=temperature, max_tokens=24, seed=5, **sampling)
    return [Group([Sample(text, c.text, c.prompt_token_ids, c.token_ids, c.logprobs, float(i), j, 0)
                   for i, c in enumerate(grp)]) for j, (text, grp) in enumerate(zip(PROMPTS, outputs))]


def _ratios(trainer: GRPOTrainer, groups: list[Group]) -> torch.Tensor:
    """exp(trainer - generator) logprob of every generated token."""
    batch = pack(groups, trainer.pad_id)
    mask = batch.loss_mask_BT > 0
    return (trainer.proximal_logprobs(batch) - batch.old_logprobs_BT)[mask].double().exp()


@pytest.mark.parametrize("temperature, truncation", [(1.0, Truncation(top_p=0.9)), (1.0, Truncation(top_k=20)),
                                                     (0.7, Truncation(top_k=20, top_p=0.9))], ids=str)
def test_ratio_is_one_at_equal_weights(vllm_engine, vllm_tiny_checkpoint, temperature, truncation):
    """Tokens vLLM sampled with top_p 0.9, top_k 20 (and both at T=0.7) get the same logprob from
    the trainer (same weights, rollout.sampling.logprobs='sampled'): max |exp(trainer - generator) - 1| <=
    1e-5. Negative control: the trainer scoring the full softmax gives the nucleus mass Z < 1."""
    groups = _groups(vllm_engine, temperature, top_p=truncation.top_p, top_k=truncation.top_k)
    trainer = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), TrainConfig(), temperature, 0, truncation=truncation
        )
    )
    ratio = _ratios(trainer, groups)
    print(f"\n{truncation} T={temperature}: {ratio.numel()} tokens, max |ratio - 1| = "
          f"{(ratio - 1).abs().max().item():.3g}")
    assert ratio.numel() > 50
    assert (ratio - 1).abs().max().item() <= 1e-5
    full = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), TrainConfig(), temperature, 0))
    z = _ratios(full, groups)
    print(f"  truncation off in the trainer: min ratio {z.min().item():.4f}, max {z.max().item():.6f}")
    assert z.max().item() <= 1 + 1e-5 and z.min().item() < 0.99


def test_raw_logprobs_give_ratio_one(vllm_engine, vllm_tiny_checkpoint):
    """rollout.sampling.logprobs='raw' (temperature 1): the trainer scores the full softmax, which is what
    vLLM's raw_logprobs mode reports for a sampled token (Sampler.compute_logprobs on the logits
    before temperature and truncation). That function is the one vLLM also scores prompt tokens
    with, so the session engine (processed mode) gives the generator's raw numbers as prompt
    logprobs of the top_p 0.9 samples: ratio 1 to <= 1e-5 (not bitwise: library kernels)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from titanrl.config import RolloutConfig

    assert Truncation.scored_by_trainer(RolloutConfig(sampling=SamplingConfig(top_p=0.9, logprobs="raw"))) is None
    groups = _groups(vllm_engine, 1.0, top_p=0.9)
    samples = [s for g in groups for s in g.samples]
    outs = vllm_engine.llm.generate(
        [TokensPrompt(prompt_token_ids=s.prompt_ids + s.completion_ids) for s in samples],
        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    raw_groups = []
    for g in groups:
        raw = []
        for s in g.samples:
            out = outs[samples.index(s)]
            seq, P = out.prompt_token_ids, len(s.prompt_ids)
            lp = [out.prompt_logprobs[i][seq[i]].logprob for i in range(P, len(seq))]
            raw.append(Sample(s.prompt, s.completion, s.prompt_ids, s.completion_ids, lp, s.reward,
                              s.group_id, 0))
        raw_groups.append(Group(raw))
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), TrainConfig(), 1.0, 0))
    ratio = _ratios(trainer, raw_groups)
    print(f"\nraw, top_p 0.9: {ratio.numel()} tokens, max |ratio - 1| = {(ratio - 1).abs().max().item():.3g}")
    assert (ratio - 1).abs().max().item() <= 1e-5
    # The processed logprobs of the same tokens are the truncated ones: a different quantity.
    processed = _ratios(trainer, groups)
    assert processed.min().item() < 0.99 and not math.isclose(processed.min().item(), ratio.min().item())


# --- config validation -------------------------------------------------------------------------------
def _config(tmp_path, checkpoint, **rollout):
    from titanrl.config import DataConfig, RolloutConfig, RunConfig

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1="}\n')
    return RunConfig(model=ModelConfig(checkpoint=str(checkpoint)), data=DataConfig(train_file=str(train)),
                     rollout=RolloutConfig(**rollout), rewards=[lambda prompt, completion, **kw: 0.0])


@pytest.mark.parametrize(
    "rollout, parallel, needles",
    [
        (dict(sampling=SamplingConfig(top_k=-1)), {}, ["rollout.sampling.top_k must be >= 0"]),
        (dict(sampling=SamplingConfig(logprobs="full")), {}, ["rollout.sampling.logprobs must be"]),
        (
            dict(sampling=SamplingConfig(top_p=0.9, logprobs="raw", temperature=0.7)),
            {},
            ["rollout.sampling.logprobs='raw'", "rollout.sampling.temperature=1"],
        ),
        (
            dict(sampling=SamplingConfig(top_k=20)),
            dict(tp=2),
            ["train.parallel.tp=2", "rollout.sampling.top_k=20", "rollout.sampling.logprobs='raw'"],
        ),
    ],
    ids=["negative top_k", "unknown logprobs", "raw needs T=1", "tp vocabulary shards"],
)
def test_validation_refuses_what_both_sides_cannot_score(tmp_path, vllm_tiny_checkpoint, rollout, parallel, needles):
    """Bad top_k / logprobs choices fail before any actor starts, naming the fields to change; the
    same settings without the conflict pass (raw at T=1, truncation with tp=1, tp=2 untruncated)."""
    from titanrl.config import ParallelConfig, validate
    from titanrl.errors import ConfigError

    config = _config(tmp_path, vllm_tiny_checkpoint, **rollout)
    config.train.parallel = ParallelConfig(**parallel)
    with pytest.raises(ConfigError) as info:
        validate(config)
    assert all(n in str(info.value) for n in needles), str(info.value)
    validate(_config(tmp_path, vllm_tiny_checkpoint, sampling=SamplingConfig(top_p=0.9, logprobs="raw")))
    validate(_config(tmp_path, vllm_tiny_checkpoint, sampling=SamplingConfig(top_k=20, top_p=0.9, temperature=0.7)))


class _TwoTurns:
    """Answers the first model turn with a fixed observation, ends after the second."""

    stop_strings: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row):
        return row["prompt"]

    async def step(self, action):
        from titanrl.envs.base import StepResult

        self.turns += 1
        return StepResult(observation="\n<obs>ok</obs>\n", reward=1.0, done=self.turns >= 2, info={})

    async def close(self):
        pass


def test_episodes_sample_and_score_under_top_k(vllm_engine, vllm_tiny_checkpoint):
    """Multi-turn episodes (AsyncGenerator, run_episode) pass top_k to vLLM: their model tokens'
    logprobs are the truncated distribution's, which the truncated head reproduces (<= 1e-5);
    if top_k did not reach the engine they would be full-softmax logprobs and differ."""
    import asyncio

    from titanrl.models.hf_checkpoint import load_model
    from titanrl.rollout.episode import EpisodeBudget, run_episode
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    budget = EpisodeBudget(max_turns=2, max_total_tokens=200, max_tokens_per_turn=8, max_model_len=256)

    async def main():
        async with AsyncGenerator(vllm_engine) as gen:
            return await asyncio.gather(*(
                run_episode(_TwoTurns(), {"prompt": f"q{i}:"}, gen, vllm_engine.llm.get_tokenizer(), budget, 1.0, 1.0,
                            seed=10 * i, stop_token_ids=None, top_k=5) for i in range(3)))

    model, _ = load_model(vllm_tiny_checkpoint)
    for ep in asyncio.run(main()):
        assert ep.error is None and ep.turns == 2
        ids = torch.tensor(ep.prompt_ids + ep.completion_ids)
        with torch.no_grad():
            hidden = model.hidden_states(ids[None, :-1])[0]
            lp = chunked_token_logprobs(hidden, model.lm_head.weight, ids[1:], truncation=Truncation(top_k=5))[0]
        mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
        got = lp[len(ep.prompt_ids) - 1:][mask]
        assert (got - torch.tensor(ep.gen_logprobs)[mask]).abs().max() <= 1e-5


def test_targets_outside_the_kept_set_are_counted_and_finite(vllm_engine, vllm_tiny_checkpoint):
    """With top_k=1 (the kept set is the argmax) the last token of every completion is replaced by
    another one: each is outside the trainer's kept set, so train/truncation_outside_frac is exactly
    samples / trained tokens, and the step stays finite (they are scored over kept + {target})."""
    import dataclasses

    groups = _groups(vllm_engine, 1.0, top_k=1)
    changed = [Group([dataclasses.replace(s, completion_ids=s.completion_ids[:-1] + [(s.completion_ids[-1] + 1) % 256])
                      for s in g.samples]) for g in groups]
    trainer = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), TrainConfig(), 1.0, 0, truncation=Truncation(top_k=1)
        )
    )
    metrics = trainer.step(changed)
    samples = sum(len(g.samples) for g in groups)
    assert metrics["train/truncation_outside_frac"] == samples / metrics["train/tokens"]
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["train/skipped"] == 0.0
    assert "train/truncation_outside_frac" not in GRPOTrainer(
        TrainerSetup(ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), TrainConfig(), 1.0, 0)
    ).step(groups)
