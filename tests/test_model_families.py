"""The Llama and Qwen2 families of the shared decoder, against the implementations they claim to be.

- transformers: checkpoints *written by transformers* (its own configs of an unusual shape: 3
  layers, hidden 96, 6 query / 2 KV heads, head_dim 32 given explicitly, biases, llama3 rope
  scaling) load into our model with logits within 1e-5, also in batch-invariant mode (1e-4, and
  then a row's logits are bitwise independent of the batch);
- export: our `save_checkpoint` writes what transformers' AutoModelForCausalLM loads unchanged;
- refusals: config.json settings our decoder cannot compute fail by name at read time;
- vLLM: our model inside vLLM decodes the same greedy tokens as vLLM's own implementation of the
  family, and in batch-invariant mode its sampled logprobs equal the trainer's bit for bit.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from titanrl.models.architectures import build_model
from titanrl.models.hf_checkpoint import CheckpointError, load_model, read_config, save_checkpoint
from titanrl.models.tiny import tiny_config, write_checkpoint
from titanrl.config import EngineConfig

FAMILIES = ("llama", "qwen2")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
"""Llama 3.1's rope scaling, with a 64-position original context so sequences of 150 exercise it."""

SHAPE = dict(vocab_size=320, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5)
"""head_dim 32 is not hidden / heads (16): a config that derived it would build other shapes."""

HF_VARIANTS = {
    "llama": {
        "biases_llama3_untied": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                     rope_parameters={**LLAMA3, "rope_theta": 50000.0}),
        "plain_tied": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    },
    "qwen2": {
        "untied": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
        "tied": dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    },
}
HF_CASES = [pytest.param(f, v, id=f"{f}-{v}") for f in FAMILIES for v in HF_VARIANTS[f]]

LENGTHS = (150, 97, 40)
"""Token rows of the logits comparisons; 150 > 64, the llama3 variant's original context."""


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    """[3, 150] random ids (the shorter LENGTHS rows are read as their prefixes)."""
    return torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, biases nonzero (transformers initialises them to 0), norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(0.08 * noise)


def _write_with_transformers(family: str, variant: str, out) -> torch.nn.Module:
    """A random model of transformers' own class and config, saved by `save_pretrained` to `out`."""
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = cls_config(**SHAPE, **HF_VARIANTS[family][variant], hidden_act="silu")
    config._attn_implementation = "eager"
    model = cls_model(config).eval()
    _randomize(model, seed=7)
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(str(out))
    return model


@pytest.mark.parametrize("family,variant", HF_CASES)
def test_transformers_checkpoint_loads_with_matching_logits(tmp_path, family, variant):
    """A checkpoint transformers wrote (its config.json and tensor names, explicit head_dim, biases,
    rope theta/scaling in `rope_parameters`) loads into our model with float32 logits within 1e-5
    of transformers' own forward over 150 tokens, for every position of rows padded to 150.
    The llama3 variant also shows the scaling is applied: without it the logits move by > 1e-2.
    Batch-invariant mode computes the same function (within 1e-4) and a row's logits there are
    bitwise equal alone and inside the batch."""
    theirs = _write_with_transformers(family, variant, tmp_path / "hf")
    ours, config = load_model(tmp_path / "hf")
    assert type(ours).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert config.head_dim == 32 and config.rope_theta == 50000.0 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings == theirs.config.tie_word_embeddings
    biases = {n for n, _ in ours.named_parameters() if n.endswith(".bias")}
    if family == "qwen2":  # q/k/v carry biases, o_proj and the MLP do not
        assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj"}
    else:
        expected = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert {n.split(".")[-2] for n in biases} == (expected if theirs.config.attention_bias else set())
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name

    tokens = _tokens(SHAPE["vocab_size"])
    with torch.no_grad():
        ref = theirs(tokens).logits
        got = ours(tokens)
        assert ref.abs().max() > 0.5  # not a degenerate comparison
        assert (got - ref).abs().max().item() <= 1e-5

        if config.rope_scaling is not None:
            unscaled = copy.deepcopy(ours)
            unscaled.model.rotary_emb.scaling = None
            assert (unscaled(tokens) - ref).abs().max().item() > 1e-2

        ours.set_batch_invariant(True)
        batch = ours(tokens)
        assert (batch - ref).abs().max().item() <= 1e-4
        for i, n in enumerate(LENGTHS):  # right padding: a row's first n positions see only its tokens
            alone = ours(tokens[i : i + 1, :n])[0]
            assert torch.equal(alone, batch[i, :n]), (i, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_checkpoint_is_what_transformers_loads(tmp_path, family):
    """Our `save_checkpoint` of a model built from our own config (Llama: all biases and llama3
    scaling; Qwen2: q/k/v biases; both untied, head_dim != hidden / heads) is read by
    transformers' AutoModelForCausalLM as the same family with every tensor equal and logits
    within 1e-5, and read back by us as an equal config."""
    from transformers import AutoModelForCausalLM

    extra = dict(attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3) if family == "llama" else {}
    config = tiny_config(family, **{**SHAPE, "tie_word_embeddings": False, "rope_theta": 50000.0}, **extra)
    model = build_model(config)
    model.init_weights(seed=3, std=0.08)
    with torch.no_grad():  # norms away from 1, so a dropped norm weight would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if n.endswith(".bias"))
    out = save_checkpoint(model, tmp_path / "ours")
    assert read_config(out) == config

    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(theirs).__name__ == config.HF_ARCHITECTURE
    if family == "llama":
        assert theirs.config.attention_bias and theirs.config.mlp_bias
        assert theirs.config.rope_parameters["rope_type"] == "llama3"
    ours_state = model.state_dict()
    theirs_state = theirs.state_dict()
    assert set(theirs_state) == set(ours_state)
    for name, tensor in theirs_state.items():
        assert torch.equal(tensor, ours_state[name]), name
    tokens = _tokens(SHAPE["vocab_size"], seed=1)
    with torch.no_grad():
        ref = theirs(tokens).logits
        assert ref.abs().max() > 0.5
        assert (model(tokens) - ref).abs().max().item() <= 1e-5


def _refusals(family: str) -> list[tuple[str, dict, str]]:
    """(case, change to config.json, regex the error must match) for `family`."""
    cases = [
        ("dynamic_rope", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         r"rope type\)? 'dynamic'"),
        ("gelu", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ]
    if family == "llama":
        cases += [
            ("yarn_rope", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
             r"rope type\)? 'yarn'"),
            # transformers < 5 spelling: top-level rope_scaling with `type`
            ("yarn_rope_legacy", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "yarn",
                                                                                                "factor": 4.0}},
             r"rope type\)? 'yarn'"),
            ("llama3_incomplete", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
             r"'llama3' rope scaling lacks low_freq_factor"),
            ("pretraining_tp", {"pretraining_tp": 2}, r"pretraining_tp=2"),
        ]
    else:
        cases += [
            ("sliding_window", {"use_sliding_window": True, "sliding_window": 64}, r"use_sliding_window=True"),
            ("layer_types", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types="),
        ]
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_unsupported_config_fields_are_refused_by_name(tmp_path, family):
    """Settings our decoder would silently compute wrong (another rope type, a sliding window, a
    non-SiLU MLP, Llama's pretraining_tp, an incomplete llama3 scaling) make `read_config` raise
    a CheckpointError (a ValueError) naming the field and value; the unmodified config reads."""
    base = tiny_config(family).to_hf_dict()
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text(json.dumps(base))
    assert read_config(tmp_path / "ok") == tiny_config(family)
    for case, change, pattern in _refusals(family):
        folder = tmp_path / case
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({k: v for k, v in {**base, **change}.items() if v is not None}))
        with pytest.raises(ValueError, match=pattern) as refused:
            read_config(folder)
        assert isinstance(refused.value, CheckpointError), case


# --- inside vLLM --------------------------------------------------------------------------
VLLM_PROMPTS = [[(7 * i + 13 * j + 1) % 250 for j in range(24 + 9 * i)] for i in range(6)]
"""6 prompts of 24 ... 69 tokens: with 16 new tokens they run past the 64-position original
context of the Llama checkpoint's llama3 scaling."""


def _vllm_checkpoint(tmp_path, family: str):
    """A tiny byte-tokenizer checkpoint (head_dim 32 for vLLM's CPU attention) of `family`: Llama
    untied with every bias and llama3 scaling, Qwen2 tied with its q/k/v biases."""
    from conftest import VLLM_TINY_OVERRIDES

    extra = dict(attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3, tie_word_embeddings=False,
                 rope_theta=10000.0) if family == "llama" else dict(tie_word_embeddings=True)
    config = tiny_config(family, max_position_embeddings=256, **extra)
    return write_checkpoint(tmp_path / f"{family}_ckpt", config, **VLLM_TINY_OVERRIDES)


@pytest.mark.own_vllm_engine
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_runs_our_model_like_vllms_own(tmp_path, family):
    """Our model inside vLLM (VllmEngine: the family's TitanRL class with vLLM's CPU kernels swapped
    in) and vLLM's built-in implementation of the family (plain `LLM(model=ckpt)`) on the same
    checkpoint decode identical greedy tokens (6 prompts x 16 tokens), and the prompt and
    sampled logprobs of the same requests are equal bit for bit."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    ckpt = _vllm_checkpoint(tmp_path, family)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in VLLM_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=str(ckpt), settings=EngineConfig(max_model_len=256, max_num_seqs=32, kv_cache_gib=0.25)
        )
    )
    try:
        model_class, classes = engine.llm.collective_rpc(
            lambda w: (type(w.get_model()).__name__, sorted({type(m).__name__ for m in w.get_model().modules()})))[0]
        assert model_class == engine.spec.vllm_architecture == f"TitanRL{engine.spec.architecture}"
        assert {"VllmAttention", "VllmCpuLinear", "VllmMLP", "VllmRotaryEmbedding"} <= set(classes)
        ours = engine.llm.generate(prompts, params, use_tqdm=False)
        builtin = LLM(model=str(ckpt), tokenizer=str(ckpt), dtype="float32", max_model_len=256, max_num_seqs=32,
                      kv_cache_memory_bytes=2**28, enforce_eager=True, seed=0)
        try:
            builtin_class = builtin.llm_engine.model_config.architectures[0]
            theirs = builtin.generate(prompts, params, use_tqdm=False)
        finally:
            builtin.llm_engine.engine_core.shutdown()
    finally:
        engine.close()
    assert builtin_class == engine.spec.architecture  # vLLM's own LlamaForCausalLM / Qwen2ForCausalLM
    diffs = []
    for a, b in zip(ours, theirs, strict=True):
        assert len(a.outputs[0].token_ids) == 16
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:], strict=True):
            diffs.append(abs(pa[t].logprob - pb[t].logprob))
        for pa, pb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True):
            diffs.append(abs(pa[t].logprob - pb[t].logprob))
    assert len(diffs) == sum(len(p) - 1 + 16 for p in VLLM_PROMPTS)
    assert max(diffs) == 0.0


@pytest.mark.own_vllm_engine
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_batch_invariant_logprobs_equal_the_trainers(tmp_path, family):
    """With `batch_invariant=True` the engine's sampled logprobs (T=1, 2 samples of each of the 6
    prompts, 16 tokens) equal the trainer model's batch-invariant logprobs of the same tokens
    exactly (one right-padded training forward over all 12 sequences)."""
    from support.logprobs import padded_forward_logprobs
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    ckpt = _vllm_checkpoint(tmp_path, family)
    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=str(ckpt),
            settings=EngineConfig(max_model_len=256, max_num_seqs=32, kv_cache_gib=0.25),
            batch_invariant=True,
        )
    )
    try:
        groups = engine.generate(VLLM_PROMPTS, n=2, temperature=1.0, max_tokens=16, seed=5)
    finally:
        engine.close()
    sampled = [c for group in groups for c in group]
    assert len(sampled) == 12 and all(c.token_ids for c in sampled)
    model, _ = load_model(ckpt)
    model.set_batch_invariant(True)
    trainer = padded_forward_logprobs(model, [c.prompt_token_ids + c.token_ids for c in sampled], grad=False)
    for c, lp in zip(sampled, trainer, strict=True):
        assert torch.equal(torch.tensor(c.logprobs), lp[len(c.prompt_token_ids) - 1 :])
