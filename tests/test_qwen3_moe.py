"""Qwen3-MoE: our model against transformers' Qwen3MoeForCausalLM on the same weights over configs
drawn across every field that changes the function, grouped matmul against the per-expert loop,
dense-or-MoE loading, config.json round trips and refusals, and the tiny-checkpoint writer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from titanrl.models.architectures import build_model
from titanrl.models.hf_checkpoint import CheckpointError, load_model, read_config, save_checkpoint
from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from titanrl.models.qwen3.moe import (
    HF_DEFAULTS,
    GroupedExperts,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Router,
    SparseMoeBlock,
)
from titanrl.models.tiny import TINY_MOE, tiny_moe_config, write_tiny_checkpoint, write_tiny_moe_checkpoint
from titanrl.models.tokenizer import vocab_size_with_specials

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=64)
"""Sizes of the drawn configs (transformers only: vLLM's CPU attention needs head_dim 32 or 64)."""


def _hf_logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        return hf(ids).logits


def _routed_experts(model: Qwen3MoeForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each sparse layer's chosen experts [N, k] on `ids`."""
    for router in model.routers():
        router.keep_routing = True
    with torch.no_grad():
        model(ids)
    out = [router.last_routing.chosen for router in model.routers()]
    for router in model.routers():
        router.keep_routing, router.last_routing = False, None
    return out


@st.composite
def moe_configs(draw) -> Qwen3MoeConfig:
    layers = draw(st.integers(1, 3))
    num_experts = draw(st.integers(1, 6))
    config = Qwen3MoeConfig(
        **SMALL,
        num_hidden_layers=layers,
        num_experts=num_experts,
        num_experts_per_tok=draw(st.integers(1, num_experts)),
        moe_intermediate_size=draw(st.sampled_from([8, 12, 24])),
        norm_topk_prob=draw(st.booleans()),
        decoder_sparse_step=draw(st.integers(1, 3)),
        mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=layers, unique=True)),
        tie_word_embeddings=draw(st.booleans()),
    )
    hypothesis.assume(config.sparse_layers)  # at least one layer with experts
    return config


@hypothesis.settings(max_examples=20, deadline=None, derandomize=True)
@hypothesis.given(config=moe_configs(), seed=st.integers(0, 2**16))
@hypothesis.example(config=Qwen3MoeConfig(**SMALL, num_hidden_layers=3, num_experts=6, num_experts_per_tok=2,
                                          moe_intermediate_size=12, norm_topk_prob=True, decoder_sparse_step=1,
                                          mlp_only_layers=[1], tie_word_embeddings=True), seed=5)
def test_logits_equal_transformers_over_configs(tmp_path_factory, config, seed):
    """Our checkpoint (save_checkpoint) loaded by transformers' AutoModelForCausalLM gives our logits
    to <= 1e-5, whatever the experts, top-k, norm_topk_prob, sparse step, mlp_only_layers and tied
    head. Weights of std 0.15 make routing non-trivial: tokens go to different experts. Our model
    with norm_topk_prob flipped moves the logits by far more than the tolerance, so the comparison
    can see that field (the negative control, in every example)."""
    model = build_model(config)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [
        config.is_sparse(i) for i in range(config.num_hidden_layers)
    ]
    model.init_weights(seed=seed, std=0.15)
    ckpt = save_checkpoint(model, tmp_path_factory.mktemp("moe") / "ckpt")
    assert read_config(ckpt) == config
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = model(ids)
    theirs = _hf_logits(ckpt, ids)
    assert (ours - theirs).abs().max().item() <= 1e-5

    if config.num_experts > config.num_experts_per_tok:
        # Not degenerate: some layer sends different tokens to different experts.
        routed = _routed_experts(model, ids)
        assert any(len({tuple(sorted(row)) for row in experts.tolist()}) > 1 for experts in routed)
        # k < E: the top-k probabilities sum to less than one, so renormalising them matters.
        for router in model.routers():
            router.norm_topk_prob = not router.norm_topk_prob
        with torch.no_grad():
            flipped = model(ids)
        assert (flipped - theirs).abs().max().item() > 1e-3


def test_tied_and_untied_heads_in_transformers(tmp_path):
    """transformers ties the head of a tied checkpoint (none stored) and reads an untied one's own."""
    for tied in (True, False):
        ckpt = write_tiny_moe_checkpoint(tmp_path / str(tied), seed=1, std=0.1, tie_word_embeddings=tied)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
        same = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        assert same == tied
        model, _ = load_model(ckpt)
        assert torch.equal(hf.lm_head.weight, model.lm_head.weight)


# ----------------------------------------------------------------------------- experts


def _experts_grads(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, implementation: str):
    experts.implementation = implementation
    experts.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = experts(x, counts)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_mm_equals_loop_with_an_idle_expert():
    """torch._grouped_mm and the per-expert loop give the same outputs and gradients (input and
    every stacked weight) to <= 1e-6, with expert 1 given no tokens: its gradient is exactly zero."""
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=4, hidden_size=32, intermediate_size=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 32)
    y_g, dx_g, dw_g = _experts_grads(experts, x, counts, "grouped_mm")
    y_l, dx_l, dw_l = _experts_grads(experts, x, counts, "loop")
    assert (y_g - y_l).abs().max() <= 1e-6 and (dx_g - dx_l).abs().max() <= 1e-6
    for name in dw_g:
        assert (dw_g[name] - dw_l[name]).abs().max() <= 1e-6, name
        assert torch.count_nonzero(dw_g[name][1]) == 0 and torch.count_nonzero(dw_l[name][1]) == 0, name
        assert all(torch.count_nonzero(dw_g[name][e]) > 0 for e in (0, 2, 3)), name


def test_experts_cast_their_weights_to_the_input_dtype():
    """float32 stacked weights run on a bf16 input as their bf16 casts (bitwise), on either path,
    and the gradient reaches the float32 weights."""
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=3, hidden_size=32, intermediate_size=16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    bf16 = GroupedExperts(num_experts=3, hidden_size=32, intermediate_size=16).to(torch.bfloat16)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in experts.state_dict().items()})
    x, counts = torch.randn(7, 32).to(torch.bfloat16), torch.tensor([2, 0, 5])
    for implementation in ("auto", "loop"):
        experts.implementation = bf16.implementation = implementation
        y = experts(x, counts)
        assert y.dtype == torch.bfloat16 and torch.equal(y, bf16(x, counts)), implementation
    y.float().sum().backward()
    assert experts.gate_proj.grad.dtype == torch.float32 and torch.count_nonzero(experts.gate_proj.grad) > 0


def test_model_grouped_mm_equals_loop():
    """A whole MoE model's logits and gradients are the same with every sparse layer on the loop
    as on grouped matmul (auto), and the auto path is the grouped one at these sizes."""
    from titanrl.models.qwen3.moe import grouped_mm_available

    config = tiny_moe_config(num_hidden_layers=2, num_experts=4)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    results = {}
    for implementation in ("auto", "loop"):
        model = build_model(config)
        model.init_weights(seed=3, std=0.1)
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.implementation = implementation
        logits = model(ids)
        logits.logsumexp(-1).sum().backward()
        results[implementation] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    experts = model.model.layers[0].mlp.experts
    assert grouped_mm_available(torch.zeros(1, config.hidden_size), experts.gate_proj, experts.down_proj) == hasattr(
        torch, "_grouped_mm")
    (la, ga), (ll, gl) = results["auto"], results["loop"]
    assert (la - ll).abs().max() <= 1e-6
    for name in ga:
        assert (ga[name] - gl[name]).abs().max() <= 1e-6, name


# ----------------------------------------------------------------------------- loading


def test_load_model_builds_dense_or_moe(tmp_path):
    """load_model reads config.json's architecture: an MoE checkpoint gives Qwen3MoeForCausalLM with
    the checkpoint's weights bitwise, a dense one the dense class."""
    moe = write_tiny_moe_checkpoint(tmp_path / "moe", seed=2, std=0.1)
    dense = write_tiny_checkpoint(tmp_path / "dense", seed=2, std=0.1)
    model, config = load_model(moe)
    assert type(model) is Qwen3MoeForCausalLM and config == tiny_moe_config()
    assert json.loads((moe / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    reference = build_model(config)
    reference.init_weights(seed=2, std=0.1)
    got = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(got[name], tensor), name
    dense_model, dense_config = load_model(dense)
    assert type(dense_model) is Qwen3ForCausalLM and type(dense_config) is Qwen3Config


def test_router_aux_loss_coef_and_every_field_round_trip(tmp_path):
    """config.json written by save_checkpoint reads back to the same config (router_aux_loss_coef,
    mlp_only_layers, the tied flag included), and transformers reads the same values."""
    config = tiny_moe_config(num_hidden_layers=3, router_aux_loss_coef=0.0125, mlp_only_layers=[1],
                             decoder_sparse_step=1, norm_topk_prob=False, tie_word_embeddings=False)
    model = build_model(config)
    model.init_weights(seed=0)
    ckpt = save_checkpoint(model, tmp_path / "c")
    assert read_config(ckpt) == config
    hf = transformers.AutoConfig.from_pretrained(str(ckpt))
    for name in ("router_aux_loss_coef", "mlp_only_layers", "norm_topk_prob", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "decoder_sparse_step", "tie_word_embeddings"):
        assert getattr(hf, name) == getattr(config, name), name


def test_reads_transformers_config_json(tmp_path):
    """A config.json transformers writes (num_experts spelt num_local_experts) reads to the config
    it was made from; a file that leaves fields out means transformers' defaults, not ours."""
    config = tiny_moe_config(num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[0],
                             router_aux_loss_coef=0.02, tie_word_embeddings=False, norm_topk_prob=True)
    hf_config = transformers.Qwen3MoeConfig(**config.to_hf_dict())
    hf_config.save_pretrained(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in written and "num_experts" not in written  # transformers 5's spelling
    assert read_config(tmp_path) == config
    from titanrl.planning import ModelShape

    assert ModelShape.from_config_json(tmp_path).num_experts == 6  # the planner reads the spelling too

    defaults = transformers.Qwen3MoeConfig()
    for name, value in HF_DEFAULTS.items():
        theirs = defaults.rope_parameters["rope_theta"] if name == "rope_theta" else getattr(defaults, name)
        assert theirs == value, name
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    bare = read_config(tmp_path)
    assert bare.norm_topk_prob is False and bare.tie_word_embeddings is False and bare.num_experts == 128
    assert bare.rope_theta == 10000.0 and bare.head_dim == 2048 // 32


def _write_config(path: Path, **changes) -> Path:
    """A real tiny MoE checkpoint whose config.json is changed by `changes` (None deletes a key)."""
    if not (path / "model.safetensors").exists():
        write_tiny_moe_checkpoint(path)
    hf = tiny_moe_config().to_hf_dict()
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    (path / "config.json").write_text(json.dumps(hf))
    return path


REFUSED = [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts=0), "num_experts"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rotary"),
    (dict(num_experts=4, num_local_experts=8), "num_local_experts"),
]


@pytest.mark.parametrize("changes,field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_fields_are_refused_by_name(tmp_path_factory, changes, field):
    """read_config refuses a config.json this model cannot compute, naming the field."""
    ckpt = _write_config(tmp_path_factory.mktemp("bad") / "c", **changes)
    with pytest.raises(CheckpointError, match=field):
        read_config(ckpt)


def test_validation_refuses_bad_moe_checkpoint_before_actors(tmp_path):
    """`validate` (what `titanrl train` runs before any actor starts) turns the refusal into a
    ConfigError naming model.checkpoint and the field; the unchanged checkpoint validates."""
    from titanrl.config import ConfigError, DataConfig, ModelConfig, RunConfig, validate

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    ckpt = write_tiny_moe_checkpoint(tmp_path / "moe")
    config = RunConfig(model=ModelConfig(checkpoint=str(ckpt)), data=DataConfig(train_file=str(train)),
                       rewards=["titanrl.models.tiny:tiny_config"])
    validate(config)
    _write_config(ckpt, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="model.checkpoint") as info:
        validate(config)
    assert "num_experts_per_tok" in str(info.value)
    # A config.json that reads but does not describe the weights (8 experts, 4 on disk), from the
    # safetensors headers alone.
    _write_config(ckpt, num_experts=8)
    with pytest.raises(ConfigError, match="model.checkpoint") as info:
        validate(config)
    assert "does not match the model config" in str(info.value) and "mlp.experts.4." in str(info.value)


# ----------------------------------------------------------------------------- tiny writer


def test_tiny_moe_config():
    """tiny_moe_config: the byte tokenizer's vocabulary, head_dim 32, 4 experts top-2, every layer
    sparse; fields override."""
    config = tiny_moe_config()
    assert isinstance(config, Qwen3MoeConfig)
    assert config.vocab_size == vocab_size_with_specials() and config.head_dim == 32
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.sparse_layers == list(range(config.num_hidden_layers))
    assert tiny_moe_config(num_experts=8, decoder_sparse_step=2).sparse_layers == [1]
    assert {k: getattr(config, k) for k in TINY_MOE} == TINY_MOE


def test_tiny_cli_writes_moe_and_dense(tmp_path, capsys):
    """`python -m titanrl.models.tiny OUT --num-experts E ...` writes an MoE checkpoint transformers
    loads; without --num-experts the checkpoint is dense; a negative count is refused."""
    from titanrl.models.tiny import main

    main([str(tmp_path / "moe"), "--num-experts", "3", "--num-experts-per-tok", "1", "--moe-intermediate-size",
          "32", "--num-hidden-layers", "1", "--untied"])
    config = read_config(tmp_path / "moe")
    assert isinstance(config, Qwen3MoeConfig) and not config.tie_word_embeddings
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (3, 1, 32)
    assert config.num_hidden_layers == 1
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(0))
    model, _ = load_model(tmp_path / "moe")
    with torch.no_grad():
        assert (model(ids) - _hf_logits(tmp_path / "moe", ids)).abs().max() <= 1e-5
    main([str(tmp_path / "dense")])
    assert type(read_config(tmp_path / "dense")) is Qwen3Config
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--num-experts", "-1"])
    assert "--num-experts" in capsys.readouterr().err


def test_tiny_cli_config_json_of_an_moe_model(tmp_path):
    """--config-json takes an MoE config.json (the published Qwen3-30B-A3B's reads as one, with the
    byte tokenizer's special ids); a small one is written and loads as MoE."""
    from titanrl.models.tiny import EOS_TOKEN_ID, config_from_hf_json, main

    big = config_from_hf_json(CONFIGS / "qwen3-30b-a3b.json")
    assert isinstance(big, Qwen3MoeConfig) and big.eos_token_id == EOS_TOKEN_ID
    assert (big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size) == (128, 8, 768)
    assert big.norm_topk_prob and not big.tie_word_embeddings and big.sparse_layers == list(range(48))
    hf = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    small = {**hf, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]}
    (tmp_path / "small.json").write_text(json.dumps(small))
    main([str(tmp_path / "out"), "--config-json", str(tmp_path / "small.json")])
    model, config = load_model(tmp_path / "out")
    assert type(model) is Qwen3MoeForCausalLM and config.mlp_only_layers == [0] and config.sparse_layers == [1]
    assert dataclasses.replace(config, eos_token_id=None, bos_token_id=None) == dataclasses.replace(
        config_from_hf_json(tmp_path / "small.json"), eos_token_id=None, bos_token_id=None)


def test_router_is_float32_under_bfloat16_weights():
    """A bf16 model's router scores in float32 (the routing weights too) and its experts compute in bf16."""
    config = tiny_moe_config(num_hidden_layers=1)
    model = build_model(config)
    model.init_weights(seed=0, std=0.1)
    model = model.to(torch.bfloat16)
    router: Router = model.routers()[0]
    router.keep_routing = True
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 4]]))
    assert out.dtype == torch.bfloat16
    assert router.last_routing.logits.dtype == torch.float32 and router.last_routing.weights.dtype == torch.float32
