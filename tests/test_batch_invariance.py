"""Batch-invariant mode end to end: trainer and vLLM give every token the same logprob bits.

Every comparison is `torch.equal` (or `==` on token lists): the claim is exact equality.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanrl.config import EngineConfig, MemoryConfig, ModelConfig, OptimizerConfig, SamplingConfig, TrainConfig
from titanrl.models.hf_checkpoint import load_model
from titanrl.models.tiny import write_tiny_checkpoint
from titanrl.trainer.batch import pack
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.truncation import Truncation
from titanrl.types import Group, Sample
from titanrl.trainer.setup import TrainerSetup

from support.logprobs import padded_forward_logprobs


@pytest.fixture(scope="module")
def bi_checkpoint(tmp_path_factory):
    """Tiny checkpoint with peaked distributions; 2 layers, head_dim 32, GQA 4:2, 4096 positions."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("bi") / "ckpt", seed=11, std=0.1)


def test_trainer_logprobs_do_not_depend_on_the_batch(bi_checkpoint):
    """A sequence's per-token logprobs (with autograd on, as in training) are bitwise equal at batch
    size 1, 7 and 37 with mixed lengths and padding, wherever the sequence sits in the batch."""
    model, _ = load_model(bi_checkpoint)
    model.set_batch_invariant(True).train()
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, 90, (37,), generator=g)]
    alone = [padded_forward_logprobs(model, [s], grad=True)[0] for s in pool[:7]]
    in_seven = padded_forward_logprobs(model, pool[:7][::-1], grad=True)[::-1]
    in_37 = padded_forward_logprobs(model, pool[30:] + pool[:30], grad=True)
    in_37 = in_37[7:14]  # pool[:7] sit at positions 7..13 after the rotation
    for a, b, c in zip(alone, in_seven, in_37):
        assert torch.equal(a, b) and torch.equal(a, c)
    no_grad = padded_forward_logprobs(model, pool[:7], grad=False)
    assert all(torch.equal(a, b) for a, b in zip(alone, no_grad))
    # The library path is not invariant on this CPU, which is why the mode exists.
    model.set_batch_invariant(False)
    plain_alone = [padded_forward_logprobs(model, [s], grad=False)[0] for s in pool[:7]]
    plain_batch = padded_forward_logprobs(model, pool[:7], grad=False)
    assert all((a - b).abs().max() < 1e-4 for a, b in zip(plain_alone, plain_batch))


def _engine(checkpoint, max_num_seqs: int = 64, **kwargs):
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    settings = EngineConfig(max_model_len=512, max_num_seqs=max_num_seqs)
    return VllmEngine(VllmEngineConfig(checkpoint=str(checkpoint), batch_invariant=True, settings=settings, **kwargs))


def _prompt_logprobs(engine, seq: list[int]) -> torch.Tensor:
    """vLLM's logprobs of a fixed token sequence computed in one prefill (prompt logprobs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)[0]
    return torch.tensor([pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], seq[1:])])


@pytest.mark.own_vllm_engine
def test_vllm_decode_prefill_chunked_prefill_and_trainer_agree(bi_checkpoint):
    """The same tokens get bitwise-equal logprobs from vLLM decode (sampled, T=1), from a vLLM
    prefill of the whole sequence, from a chunked prefill (48-token chunks, prefix cache on), and
    from the trainer's forward; one prompt alone and inside a batch of 64 gives identical tokens
    and logprobs (greedy and seeded sampling)."""
    model, _ = load_model(bi_checkpoint)
    model.set_batch_invariant(True).train()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 75, 130)]

    engine = _engine(bi_checkpoint)
    try:
        groups = engine.generate(prompts, n=2, temperature=1.0, max_tokens=24, seed=7)
        sampled = [c for grp in groups for c in grp]
        sequences = [c.prompt_token_ids + c.token_ids for c in sampled]
        trainer = padded_forward_logprobs(model, sequences, grad=True)
        for c, lp in zip(sampled, trainer):
            decode = torch.tensor(c.logprobs)
            assert torch.equal(decode, lp[len(c.prompt_token_ids) - 1 :])
        prefill = [_prompt_logprobs(engine, s) for s in sequences]
        assert all(torch.equal(p, lp) for p, lp in zip(prefill, trainer))

        crowd = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(2, 60, (63,), generator=g)]
        for temperature, seed in ((0.0, None), (1.0, 3)):
            (alone,) = engine.generate([prompts[3]], n=1, temperature=temperature, max_tokens=20, seed=seed)[0]
            batch = engine.generate(crowd[:40] + [prompts[3]] + crowd[40:], n=1, temperature=temperature,
                                    max_tokens=20, seed=seed)
            (inside,) = batch[40]
            if seed is not None:  # a request's seed is seed + its index: give it the same one alone
                (alone,) = engine.generate([prompts[3]], n=1, temperature=temperature, max_tokens=20,
                                           seed=seed + 40)[0]
            assert alone.token_ids == inside.token_ids
            assert torch.equal(torch.tensor(alone.logprobs), torch.tensor(inside.logprobs))
    finally:
        engine.close()

    chunked = _engine(bi_checkpoint, max_num_seqs=16,
                      extra_llm_kwargs={"max_num_batched_tokens": 48, "enable_chunked_prefill": True})
    try:
        long = [s for s in sequences if len(s) > 48]
        assert long, "need sequences longer than one chunk"
        for s, lp in zip(sequences, trainer):
            if len(s) > 48:
                assert torch.equal(_prompt_logprobs(chunked, s), lp)
        # Greedy decode after a chunked prefill (seeded sampling + chunking hits a vLLM CPU bug).
        (out,) = chunked.generate([prompts[4]], n=1, temperature=0.0, max_tokens=16)[0]
        lp = padded_forward_logprobs(model, [out.prompt_token_ids + out.token_ids], grad=False)[0]
        assert torch.equal(torch.tensor(out.logprobs), lp[len(out.prompt_token_ids) - 1 :])
    finally:
        chunked.close()


@pytest.mark.own_vllm_engine
def test_trainer_parity_metrics_are_exactly_zero(bi_checkpoint):
    """GRPOTrainer(batch_invariant=True) recomputes every token vLLM sampled with the current
    weights to the bit: parity/logprob_diff_max is 0.0 over all tokens; stale rows are not counted.
    The same holds for top_p 0.9 and top_k 20 sampling (T=1, and both at T=0.7) scored under the
    truncated distribution (rollout.sampling.logprobs='sampled'): vLLM's CPU top-k / top-p is per row."""
    engine = _engine(bi_checkpoint)
    truncated = [(1.0, Truncation(top_p=0.9)), (1.0, Truncation(top_k=20)), (0.7, Truncation(top_k=20, top_p=0.9))]
    try:
        prompts = ["12+34=", "hello", "a much longer prompt about numbers: 98765 - 4321 ="]
        groups = engine.generate(prompts, n=4, temperature=1.0, max_tokens=16, seed=2)
        truncated_groups = [engine.generate(prompts, n=4, temperature=t, max_tokens=16, seed=2, top_p=trunc.top_p,
                                            top_k=trunc.top_k) for t, trunc in truncated]
    finally:
        engine.close()
    for (temperature, truncation), outputs in zip(truncated, truncated_groups):
        rows = [Group([Sample(text, c.text, c.prompt_token_ids, c.token_ids, c.logprobs, float(i % 2), j, 0)
                       for i, c in enumerate(grp)]) for j, (text, grp) in enumerate(zip(prompts, outputs))]
        trainer = GRPOTrainer(
            TrainerSetup(
                ModelConfig(checkpoint=str(bi_checkpoint)),
                TrainConfig(memory=MemoryConfig(micro_batch_size=5)),
                temperature,
                0,
                batch_invariant=True,
                truncation=truncation,
            )
        )
        parity = trainer.measure_parity(pack(rows, trainer.pad_id, current_version=trainer.version))
        assert parity.checked == sum(len(c.token_ids) for grp in outputs for c in grp)
        assert parity.diff_max == 0.0 and parity.different == 0, (temperature, truncation)
    batch = []
    for j, (text, grp) in enumerate(zip(prompts, groups)):
        samples = [Sample(text, c.text, c.prompt_token_ids, c.token_ids, c.logprobs, float(i % 2), j, 0)
                   for i, c in enumerate(grp)]
        batch.append(Group(samples))
    stale = Group([dataclasses.replace(s, policy_version=-1) for s in batch[0].samples])
    tc = TrainConfig(memory=MemoryConfig(micro_batch_size=3), minibatches=2)
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(bi_checkpoint)), tc, 1.0, 0, batch_invariant=True))
    metrics = trainer.step(batch + [stale])
    generated = sum(len(c.token_ids) for grp in groups for c in grp)
    assert metrics["parity/tokens_checked"] == generated
    assert metrics["parity/logprob_diff_max"] == 0.0 and metrics["parity/tokens_different_frac"] == 0.0
    plain = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(bi_checkpoint)), tc, 1.0, 0, batch_invariant=False))
    assert plain.step(batch)["parity/logprob_diff_max"] > 0.0  # library kernels: a real mismatch


def test_batch_invariant_gradients_match_the_library_model(bi_checkpoint):
    """The batch-invariant model trains the same function: its loss gradients equal the library
    model's to <= 1e-5 on a GRPO batch (only the rounding differs)."""
    g = torch.Generator().manual_seed(4)
    groups = []
    for j in range(3):
        prompt = torch.randint(0, 256, (5 + j,), generator=g).tolist()
        samples = []
        for i in range(4):
            completion = torch.randint(0, 256, (6 + i,), generator=g).tolist()
            samples.append(Sample("p", "c", prompt, completion, [-1.0] * len(completion), float(i), j, 0))
        groups.append(Group(samples))
    grads = {}
    for flag in (False, True):
        trainer = GRPOTrainer(
            TrainerSetup(ModelConfig(checkpoint=str(bi_checkpoint)), TrainConfig(), 1.0, 0, batch_invariant=flag)
        )
        trainer.accumulate_gradients(pack(groups, trainer.pad_id))
        grads[flag] = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    for name, grad in grads[False].items():
        assert (grad - grads[True][name]).abs().max().item() <= 1e-5, name


@pytest.mark.slow
def test_runs_have_zero_mismatch_and_repeat_to_the_bit(tmp_path, ray_session, tiny_run):
    """Two seeded `batch_invariant=True` continuous-mode runs (Ray actors, vLLM worker) whose
    engine batches the sequences differently (rollout.engine.max_num_seqs 16: all of a step's
    sequences in one forward pass; 2: two at a time) write identical loss, reward/mean and
    grad_norm columns, and every step's parity/logprob_diff_max is exactly 0.0 over all
    generated tokens.

    The batches differ on purpose because that is what only batch invariance survives: in
    continuous mode which sequences share a forward pass is up to timing and load, and without
    the mode a token's logprob bits depend on it (checked by hand: with batch_invariant=False
    these two runs' columns differ). Two identical runs would not prove the mode: lock-step runs
    repeat without it, and so did two continuous runs on an idle machine. max_staleness=0: no
    new weights arrive while a group is generated (an in-flight update's timing decides which
    version samples a token, which no mode can make repeat)."""
    import titanrl

    def run(name: str, max_num_seqs: int):
        config = titanrl.RunConfig(
            model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
            data=titanrl.DataConfig(train_file=str(tiny_run.train_file)),
            rollout=titanrl.RolloutConfig(
                prompts_per_step=4,
                group_size=4,
                sampling=SamplingConfig(max_new_tokens=8),
                engine=EngineConfig(max_model_len=64, max_num_seqs=max_num_seqs),
                continuous=True,
            ),
            train=titanrl.TrainConfig(steps=4, optimizer=OptimizerConfig(lr=3e-3), minibatches=2, max_staleness=0),
            output=titanrl.OutputConfig(dir=str(tmp_path / name), progress_bar=False),
            rewards=[tiny_run.reward],
            batch_invariant=True,
            seed=9,
        )
        return [m for m in titanrl.train(config).metrics if "loss" in m]

    first, second = run("a", max_num_seqs=16), run("b", max_num_seqs=2)
    assert len(first) == 4
    columns = [(m["loss"], m["reward/mean"], m["grad_norm"]) for m in first]
    assert columns == [(m["loss"], m["reward/mean"], m["grad_norm"]) for m in second]
    assert len({c[0] for c in columns}) > 1  # the policy moved: not a constant column
    for m in first + second:
        assert m["parity/logprob_diff_max"] == 0.0 and m["parity/tokens_different_frac"] == 0.0
        assert m["parity/tokens_checked"] == m["train/tokens"] > 0

