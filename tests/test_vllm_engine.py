"""vLLM rollout engine running TitanRL's own Qwen3 modules, with in-place weight pushes."""

import pytest
import torch

pytest.importorskip("vllm")

from titanrl.config import EngineConfig
from titanrl.models.hf_checkpoint import hf_state_dict, load_model, load_state_dict_into  # noqa: E402
from titanrl.models.tiny import write_tiny_checkpoint  # noqa: E402

TOL = 1e-5


def _perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def _our_logprobs(model, seq: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of token t+1 given tokens <= t, as the trainer computes it."""
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]


def _completion_logprob_diff(model, completion, temperature: float) -> float:
    seq = completion.prompt_token_ids + completion.token_ids
    ours = _our_logprobs(model, seq, temperature)[len(completion.prompt_token_ids) - 1 :]
    return (ours - torch.tensor(completion.logprobs)).abs().max().item()


def _vllm_scores(engine, seq: list[int]) -> torch.Tensor:
    """vLLM's logprobs (temperature 1) of a fixed token sequence, via prompt logprobs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    return torch.tensor([pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], seq[1:])])


def test_weight_push_matches_our_forward(vllm_engine, vllm_tiny_checkpoint):
    """After an in-place push, vLLM's logprobs equal our model's forward on the new weights (<= 1e-5),
    both for fixed sequences and for freshly sampled tokens at T=0.7, and differ from before the push;
    pushing the old weights back restores the old logprobs exactly. Embeddings are tied, so this
    also proves the LM head follows the pushed embedding."""
    old_model, _ = load_model(vllm_tiny_checkpoint)
    old_state = hf_state_dict(old_model)
    new_state = _perturbed(old_state, seed=1)
    new_model, _ = load_model(vllm_tiny_checkpoint)
    load_state_dict_into(new_model, new_state)

    groups = vllm_engine.generate(["weights: ", "push"], n=2, temperature=1.0, max_tokens=12, seed=5)
    fixed = [c.prompt_token_ids + c.token_ids for g in groups for c in g]
    for c in (c for g in groups for c in g):
        assert _completion_logprob_diff(old_model, c, 1.0) <= TOL
    before = [_vllm_scores(vllm_engine, s) for s in fixed]
    for s, b in zip(fixed, before):
        assert (b - _our_logprobs(old_model, s)).abs().max().item() <= TOL

    start_version = vllm_engine.policy_version
    try:
        vllm_engine.update_weights(new_state, version=start_version + 1)
        assert vllm_engine.policy_version == start_version + 1
        running = vllm_engine.worker_state_dict()
        assert all(torch.equal(running[k], new_state[k]) for k in new_state)

        after = [_vllm_scores(vllm_engine, s) for s in fixed]
        for s, a, b in zip(fixed, after, before):
            assert (a - _our_logprobs(new_model, s)).abs().max().item() <= TOL
            assert (a - b).abs().max().item() > 1e-3  # the push changed what vLLM computes

        fresh = vllm_engine.generate(["after the push"], n=3, temperature=0.7, max_tokens=12, seed=9)[0]
        for c in fresh:
            assert c.policy_version == start_version + 1
            assert _completion_logprob_diff(new_model, c, 0.7) <= TOL
    finally:
        vllm_engine.update_weights(old_state, version=start_version + 2)
    restored = [_vllm_scores(vllm_engine, s) for s in fixed]
    assert all(torch.equal(r, b) for r, b in zip(restored, before))


def test_greedy_alone_equals_in_batch(vllm_engine):
    """Greedy decoding of a prompt gives the same tokens (and logprobs to 1e-5) alone and inside a batch."""
    prompt = "In a batch or not: "
    others = [f"other prompt {i} " * (i + 1) for i in range(7)]
    alone = vllm_engine.generate([prompt], temperature=0.0, max_tokens=24)[0][0]
    batch = vllm_engine.generate(others[:3] + [prompt] + others[3:], temperature=0.0, max_tokens=24)
    inside = batch[3][0]
    assert inside.prompt_token_ids == alone.prompt_token_ids
    assert inside.token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, inside.logprobs)) <= TOL


def test_generate_shapes_seeds_and_token_prompts(vllm_engine):
    """generate returns n completions per prompt with one logprob per token; a seed makes it
    reproducible, gives every sample its own stream, and token-id prompts equal string prompts."""
    a = vllm_engine.generate(["ab", "ab"], n=3, temperature=1.0, max_tokens=6, seed=11)
    assert [len(g) for g in a] == [3, 3]
    for g in a:
        for c in g:
            assert len(c.token_ids) == len(c.logprobs) <= 6 and c.finish_reason in ("stop", "length")
    samples = [tuple(c.token_ids) for g in a for c in g]
    assert len(set(samples)) == len(samples)  # identical prompts still get distinct streams
    # The seed layout (titanrl.rollout.seeds): sample i of prompt j is seeded seed + j * n + i.
    for j, i in [(0, 0), (1, 2)]:
        alone = vllm_engine.generate(["ab"], n=1, temperature=1.0, max_tokens=6, seed=11 + j * 3 + i)[0][0]
        assert alone.token_ids == a[j][i].token_ids
    ids = a[0][0].prompt_token_ids
    b = vllm_engine.generate([ids, ids], n=3, temperature=1.0, max_tokens=6, seed=11)
    assert [[c.token_ids for c in g] for g in b] == [[c.token_ids for c in g] for g in a]
    assert [[c.logprobs for c in g] for g in b] == [[c.logprobs for c in g] for g in a]


@pytest.mark.slow
def test_multiprocess_engine_untied_push(tmp_path):
    """The multiprocess engine (engine core in a spawned process, which sees our architecture only
    through the `vllm.general_plugins` entry point) generates with our model, and a push of an
    untied checkpoint's weights (separate lm_head) crosses the process boundary exactly."""
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=4, std=0.1, tie_word_embeddings=False)
    model, _ = load_model(ckpt)
    new_state = _perturbed(hf_state_dict(model), seed=2)
    assert "lm_head.weight" in new_state
    load_state_dict_into(model, new_state)
    config = VllmEngineConfig(
        checkpoint=str(ckpt), settings=EngineConfig(max_model_len=128, max_num_seqs=8, multiprocess=True)
    )
    with VllmEngine(config) as eng:
        assert eng.generate(["mp"], n=2, max_tokens=4, seed=0)[0][1].token_ids
        eng.update_weights(new_state, version=1)
        group = eng.generate(["mp"], n=2, temperature=1.0, max_tokens=8, seed=0)[0]
    for c in group:
        assert c.policy_version == 1
        assert _completion_logprob_diff(model, c, 1.0) <= TOL


def test_many_long_seeded_prompts_at_once_do_not_split_a_prefill(vllm_engine):
    """Seeded requests whose prompts together exceed one step's token budget (4096 on CPU):
    vLLM on CPU crashes ("CPU Generator does not use offset") if it splits a seeded prompt by
    chunked prefill, which the engine therefore turns off. Also reproducible: same seed, same tokens."""
    prompts = [[(7 * j + t) % 250 for t in range(200)] for j in range(32)]  # 6400 prompt tokens
    first = vllm_engine.generate(prompts, n=1, temperature=1.0, max_tokens=8, seed=5)
    again = vllm_engine.generate(prompts, n=1, temperature=1.0, max_tokens=8, seed=5)
    assert [c.token_ids for (c,) in first] == [c.token_ids for (c,) in again]
    assert all(len(c.token_ids) > 0 for (c,) in first)
    assert vllm_engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False


def test_sampled_logprobs_reads_flat_and_dict_records_alike():
    """`sampled_logprobs` gives each sampled token's logprob from vLLM's flat record and from its
    per-position dicts alike, including a flat record that holds more than the sampled token."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from titanrl.rollout.vllm.engine import sampled_logprobs

    ids = [5, 9, 2]
    sampled = [{5: Logprob(-0.25, 3)}, {9: Logprob(-1.5, 1)}, {2: Logprob(-0.125, 7)}]
    flat = FlatLogprobs()
    for position in sampled:
        flat.append(position)
    assert sampled_logprobs(flat, ids) == sampled_logprobs(sampled, ids) == [-0.25, -1.5, -0.125]
    # With top logprobs too, a position holds other tokens: the sampled one is still picked out.
    wide = [{5: Logprob(-0.25, 3), 1: Logprob(-0.5, 1)}, {9: Logprob(-1.5, 1)}, {4: Logprob(-0.75, 1), 2: Logprob(-0.125, 7)}]
    wide_flat = FlatLogprobs()
    for position in wide:
        wide_flat.append(position)
    assert sampled_logprobs(wide_flat, ids) == [-0.25, -1.5, -0.125]


def test_requests_ask_for_flat_logprobs_with_the_same_values(vllm_engine):
    """The engine's requests get flat logprobs (no Logprob object per token), and the completions'
    tokens and logprobs are exactly those of vLLM's per-token dicts on the same seeds."""
    from unittest import mock

    import vllm

    import titanrl.rollout.vllm.engine as engine_module

    records: list[type] = []
    read = engine_module.sampled_logprobs

    def recording(logprobs, ids):
        records.append(type(logprobs))
        return read(logprobs, ids)

    real = vllm.SamplingParams
    kwargs = dict(n=3, temperature=1.0, max_tokens=12, seed=11)
    with mock.patch.object(engine_module, "sampled_logprobs", recording):
        flat = vllm_engine.generate(["ab", "xyz"], **kwargs)
    with mock.patch.object(vllm, "SamplingParams", lambda *a, **kw: real(*a, **{**kw, "flat_logprobs": False})):
        dicts = vllm_engine.generate(["ab", "xyz"], **kwargs)
    assert records and {r.__name__ for r in records} == {"FlatLogprobs"}
    for f, d in zip((c for g in flat for c in g), (c for g in dicts for c in g), strict=True):
        assert f.token_ids == d.token_ids and f.logprobs == d.logprobs and len(f.logprobs) == len(f.token_ids) > 0


def test_text_prompts_get_vllms_own_token_ids(vllm_engine):
    """`generate` tokenizes text prompts itself, in one batched call (`VllmEngine.tokenize`), into
    exactly the ids vLLM makes of the same text prompts, so the completions are the same too."""
    from unittest import mock

    from vllm import SamplingParams

    prompts = ["ab", "xyz  q", "hello\nworld", "\u00e9t\u00e9 \U0001f600"]
    sent: list = []
    real = vllm_engine.llm.generate

    def spy(inputs, *args, **kwargs):
        sent.extend(inputs)
        return real(inputs, *args, **kwargs)

    with mock.patch.object(vllm_engine.llm, "generate", spy):
        ours = vllm_engine.generate(prompts, n=2, temperature=1.0, max_tokens=6, seed=3)
    assert len(sent) == len(prompts) and all(not isinstance(x, str) and "prompt_token_ids" in x for x in sent)
    # vLLM's own rendering of the text prompts, with generate's seeds (prompt r: 3 + 2 r onwards)
    theirs = real(prompts, [SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3 + 2 * r, logprobs=0)
                            for r in range(len(prompts))], use_tqdm=False)
    assert [g[0].prompt_token_ids for g in ours] == [list(o.prompt_token_ids) for o in theirs]
    assert [[c.token_ids for c in g] for g in ours] == [[list(c.token_ids) for c in o.outputs] for o in theirs]


def test_texts_decoded_at_finish_are_vllms_own(vllm_engine):
    """Requests without stop strings leave their text to `fill_texts` (`detokenize=False`), and every
    text, from lock-step `generate` and from `AsyncGenerator.generate_n`, is exactly the one vLLM's
    per-step detokenizer makes of the same tokens: random bytes of a random model (partial UTF-8
    all over), completions cut by the token limit and by a stop token (which the async path's
    text shows and lock-step's does not)."""
    import asyncio
    from collections import Counter
    from unittest import mock

    import vllm

    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    prompts = ["ab", "xyz", "hello"]
    probe = vllm_engine.generate(prompts, n=4, temperature=1.0, max_tokens=16, seed=5)
    # The most frequent sampled token as a stop token: some completions stop on it, some run out.
    stop = [Counter(t for g in probe for c in g for t in c.token_ids).most_common(1)[0][0]]
    sampling = dict(n=4, temperature=1.0, max_tokens=16, stop_token_ids=stop)

    async def generate_async():
        async with AsyncGenerator(vllm_engine) as gen:
            # generate's seeds: request i's samples get 5 + 4 i onwards, so the stop token comes up
            return await asyncio.gather(*(gen.generate_n(p, seed=5 + 4 * i, **sampling) for i, p in enumerate(prompts)))

    real = vllm.SamplingParams
    asked: list[bool] = []

    def recording(*a, **kw):
        asked.append(kw.get("detokenize", True))
        return real(*a, **kw)

    def vllm_detokenizes(*a, **kw):
        return real(*a, **{**kw, "detokenize": True})

    runs = {}
    for way, params in (("at_finish", recording), ("per_step", vllm_detokenizes)):
        with mock.patch.object(vllm, "SamplingParams", params):
            runs[way] = (vllm_engine.generate(prompts, seed=5, **sampling), asyncio.run(generate_async()))
    assert len(asked) == 2 * len(prompts) and not any(asked)
    for path in range(2):
        ours = [c for g in runs["at_finish"][path] for c in g]
        theirs = [c for g in runs["per_step"][path] for c in g]
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert {c.finish_reason for c in ours} == {"stop", "length"}
        assert any(c.text for c in ours)
        assert [c.text for c in ours] == [c.text for c in theirs]
    # The stop token's text is in the async path's completions (include_stop_str_in_output) only.
    lockstep, streamed = ([c for g in run for c in g] for run in runs["at_finish"])
    assert any(a.text != b.text for a, b in zip(lockstep, streamed, strict=True))


def test_requests_with_stop_strings_keep_vllms_detokenizer(vllm_engine):
    """A request with stop strings is detokenized by vLLM as it runs (it matches them on the text),
    and stops at one."""
    import asyncio
    from unittest import mock

    import vllm

    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    real = vllm.SamplingParams
    asked: list[bool] = []

    def recording(*a, **kw):
        asked.append(kw.get("detokenize", True))
        return real(*a, **kw)

    async def generate_async():
        async with AsyncGenerator(vllm_engine) as gen:
            free = await gen.generate_n("ab", n=8, temperature=1.0, max_tokens=24, seed=9)
            stop = max(set("".join(c.text for c in free)), key="".join(c.text for c in free).count)
            return stop, await gen.generate_n("ab", n=8, temperature=1.0, max_tokens=24, seed=9, stop=[stop])

    with mock.patch.object(vllm, "SamplingParams", recording):
        stop, stopped = asyncio.run(generate_async())
    assert asked == [False, True]
    assert any(c.finish_reason == "stop" for c in stopped)
    for c in stopped:
        assert c.text.count(stop) == (c.finish_reason == "stop") and (c.finish_reason != "stop" or c.text.endswith(stop))
