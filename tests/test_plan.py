"""`titanrl plan` and its estimator (titanrl/planning): per-term formulas against hand-computed
bytes, the activation table against what autograd really saves in our Qwen3 block, how layouts
shard each term, the recommendation, the CLI on dense and MoE config.json files, bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from titanrl.cli import main
from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from titanrl.planning.layouts import candidate_layouts, plan
from titanrl.planning.memory import (
    CPU_PROCESS_BASELINE_BYTES,
    GiB,
    Layout,
    Workload,
    block_saved_bytes,
    estimate,
    estimate_cpu_process,
    outside_saved_bytes,
)
from titanrl.planning.shape import ModelShape, PlanInputError

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"

TINY = dict(architectures=["Qwen3ForCausalLM"], vocab_size=100, hidden_size=8, intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)

TINY_MOE = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=16, intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True)


def _write(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


# ----------------------------------------------------------------------------- shapes


def test_published_configs_have_published_sizes():
    """The three example configs parse to the published parameter counts (0.6B, 8.2B, 30.5B / 3.3B active)."""
    small = ModelShape.from_config_json(CONFIGS / "qwen3-0.6b.json")
    dense = ModelShape.from_config_json(CONFIGS / "qwen3-8b.json")
    moe = ModelShape.from_config_json(CONFIGS / "qwen3-30b-a3b.json")
    assert 0.59e9 < small.total_params < 0.61e9 and small.tie_word_embeddings
    assert 8.1e9 < dense.total_params < 8.3e9 and not dense.is_moe
    assert moe.is_moe and 30.4e9 < moe.total_params < 30.6e9 and 3.2e9 < moe.active_params < 3.4e9
    # The dense planner shape and the model's own config agree on every size they share.
    cfg = Qwen3Config.from_hf_dict(json.loads((CONFIGS / "qwen3-8b.json").read_text()))
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(cfg, name) == getattr(dense, name), name


def test_moe_sparse_layers_follow_hf_rule():
    """Layer i has experts when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    shape = ModelShape.from_hf_dict({**TINY_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [shape.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    s = ModelShape.from_hf_dict(TINY_MOE)
    # 4 layers: attention 2*16*32 + 2*16*16 = 1536, norms 2*16 + 2*8 = 48; layer 0 dense 3*16*32 = 1536;
    # layers 1-3 router 16*8 = 128 + experts 3*16*12*8 = 4608; embedding + untied head 2*96*16; final norm 16.
    assert s.total_params == 4 * (1536 + 48) + 1536 + 3 * (128 + 4608) + 2 * 96 * 16 + 16


# ----------------------------------------------------------------------------- formulas


def test_single_process_terms_equal_hand_computed_bytes():
    """Every term for the tiny dense config, one float32 process, equals the bytes worked out by hand."""
    shape = ModelShape.from_hf_dict(TINY)
    work = Workload(seq_len=16, batch=4, micro_batch=2, logprob_chunk_tokens=8, device="cpu")
    e = estimate(shape, Layout(), work)
    # params: embedding 100*8 = 800 (tied: the head is the same matrix); per layer q,k,v,o
    # 8*8 + 8*4 + 8*4 + 8*8 = 192, norms 2*8 + 2*4 = 24, MLP 3*8*16 = 384; final norm 8.
    n = 800 + 2 * (192 + 24 + 384) + 8
    assert e.parameter_elements == n == 2008
    assert (e.parameters, e.master_weights, e.gradients, e.optimizer_state) == (4 * n, 0, 4 * n, 8 * n)
    assert e.schedule.micro_batches == 2 and e.schedule.tokens_per_micro_batch == 32
    # activations, float32, per token of a block: 24*hidden + 24*q + 8*kv + 16*intermediate
    # + 8*heads + 4*kv_heads + 8 = 192 + 192 + 32 + 256 + 16 + 4 + 8 = 700; 32 tokens, 2 blocks;
    # outside: final norm 12*8, rotary 8*4, 12 per token = 140.
    assert e.activations_stored == 32 * (2 * 700 + 140) == 49280
    # checkpointed: two block inputs (32 tokens x 8 x 4 bytes), the outside terms, one block recomputed.
    assert e.activations_checkpointed == 2 * 32 * 8 * 4 + 32 * 140 + 32 * 700 == 28928
    # logits: 2 float32 [tokens, vocab] copies; chunked: 8 tokens at a time.
    assert (e.logits_full, e.logits_chunked) == (2 * 4 * 32 * 100, 2 * 4 * 8 * 100)
    assert e.fsdp_buffers == 0 and e.gradient_accumulation == 0  # one process, no cast: parameters in place
    assert e.optimizer_step == 0  # fused AdamW updates in place
    # The embedding's and the tied head's gradients are added in place in one float32 process.
    assert e.embedding_gradients == 0
    assert e.peak == 16 * n + 49280 + 6400 + CPU_PROCESS_BASELINE_BYTES
    assert estimate_cpu_process(shape, replace(work, device="cuda")) == e
    # bf16 storage: a float32 master copy joins; gradients and moments stay float32.
    b = estimate(shape, Layout(), replace(work, dtype="bfloat16", compute_dtype="bfloat16"))
    assert (b.parameters, b.master_weights, b.gradients, b.optimizer_state) == (2 * n, 4 * n, 4 * n, 8 * n)
    # The KL reference policy: one more copy of the stored shards, nothing else.
    k = estimate(shape, Layout(), replace(work, dtype="bfloat16", compute_dtype="bfloat16", kl_reference=True))
    assert e.reference == b.reference == 0 and k.reference == 2 * n and k.peak == b.peak + 2 * n


def _autograd_saved_bytes(config: Qwen3Config, dtype: torch.dtype, B: int, T: int) -> int:
    """Bytes of the unique non-parameter storages autograd saves in a forward to logits."""
    model = Qwen3ForCausalLM(config).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, config.vocab_size, (B, T)))
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_table_equals_what_autograd_saves(dtype):
    """block_saved_bytes + outside_saved_bytes equal the bytes autograd keeps in titanrl's Qwen3
    forward (counted with saved_tensors_hooks), exactly, for two different shapes."""
    for hf in (TINY, {**TINY, "hidden_size": 24, "intermediate_size": 40, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 3}):
        shape = ModelShape.from_hf_dict(hf)
        config = Qwen3Config.from_hf_dict(hf)
        B, T = 2, 12
        b = 4 if dtype == torch.float32 else 2
        expected = sum(block_saved_bytes(shape, i, b, B * T, Layout()) for i in range(shape.num_hidden_layers))
        expected += outside_saved_bytes(shape, b, B * T, True, Layout())
        assert _autograd_saved_bytes(config, dtype, B, T) == expected


# ----------------------------------------------------------------------------- layouts


def test_doubling_dp_shard_halves_sharded_terms():
    """Parameters, gradients and optimizer state are FSDP-sharded: twice the dp_shard ranks, half the bytes."""
    shape = ModelShape.from_config_json(CONFIGS / "qwen3-8b.json")
    work = Workload(seq_len=4096, batch=256, compute_dtype="bfloat16")
    two, four = estimate(shape, Layout(dp_shard=2), work), estimate(shape, Layout(dp_shard=4), work)
    for term in ("parameters", "gradients", "optimizer_state"):
        assert getattr(two, term) == 2 * getattr(four, term), term
    assert two.parameters == 4 * shape.total_params // 2


def test_tensor_parallel_shards_vocabulary_parallel_logits():
    """Under tp each rank holds vocab / tp of the logits (full, and chunks of a given size), for the
    same tokens; the default chunk is a fixed size per rank (more tokens over a narrower shard)."""
    shape = ModelShape.from_config_json(CONFIGS / "qwen3-0.6b.json")
    work = Workload(seq_len=512, batch=8, compute_dtype="bfloat16", logprob_chunk_tokens=1024)
    one, two = estimate(shape, Layout(), work), estimate(shape, Layout(tp=2), work)
    assert one.schedule.tokens_per_micro_batch == two.schedule.tokens_per_micro_batch == 8 * 512
    assert one.logits_full == 2 * two.logits_full == 2 * 4 * 8 * 512 * 151936
    assert one.logits_chunked == 2 * two.logits_chunked
    assert two.logits_chunked < two.logits_full
    auto = Workload(seq_len=512, batch=8, compute_dtype="bfloat16")
    one, two = estimate(shape, Layout(), auto), estimate(shape, Layout(tp=2), auto)
    assert one.logits_chunked == 2 * 4 * 220 * 151936  # 220 tokens: 128 MiB of float32 logits
    assert abs(two.logits_chunked - one.logits_chunked) <= 2 * 4 * 151936  # within one token's row


def test_checkpointing_lowers_activations_and_peak():
    shape = ModelShape.from_config_json(CONFIGS / "qwen3-8b.json")
    work = Workload(seq_len=4096, batch=64, micro_batch=1, compute_dtype="bfloat16")
    none = estimate(shape, Layout(dp_shard=8), work)
    full = estimate(shape, Layout(dp_shard=8), replace(work, activation_checkpointing="full"))
    assert full.activations_checkpointed < none.activations_stored / 10
    assert full.activations == none.activations_checkpointed and full.peak < none.peak


def test_expert_parallel_borrows_ranks_and_shrinks_gathered_experts():
    """ep does not multiply the world size; experts stay sharded over dp_shard x cp x tp, and
    each rank gathers only its experts."""
    shape = ModelShape.from_hf_dict(TINY_MOE)
    work = Workload(seq_len=32, batch=8, compute_dtype="bfloat16")
    layouts = candidate_layouts(shape, 8, work)
    assert {lay.world_size for lay in layouts} == {8} and max(lay.ep for lay in layouts) == 8
    one, four = estimate(shape, Layout(dp_shard=8), work), estimate(shape, Layout(dp_shard=8, ep=4), work)
    assert one.parameters == four.parameters
    assert four.fsdp_buffers < one.fsdp_buffers
    dense = ModelShape.from_config_json(CONFIGS / "qwen3-8b.json")
    assert {lay.ep for lay in candidate_layouts(dense, 8, work)} == {1}


def test_recommendation_fits_and_less_memory_changes_it():
    shape = ModelShape.from_config_json(CONFIGS / "qwen3-8b.json")
    work = Workload(seq_len=4096, batch=256, compute_dtype="bfloat16", activation_checkpointing="full")
    roomy = plan(shape, 64, 80, work)
    assert roomy.recommended is not None and roomy.recommended.memory.peak <= roomy.budget
    assert all(c.fits == (c.memory.peak <= roomy.budget) for c in roomy.candidates)
    # Just below the recommended layout's peak it no longer fits: another layout or none.
    tight_gib = roomy.recommended.memory.peak / GiB / (1 - roomy.margin) * 0.99
    tight = plan(shape, 64, tight_gib, work)
    assert tight.recommended is None or tight.recommended.layout != roomy.recommended.layout
    assert plan(shape, 64, 4, work).recommended is None


# ----------------------------------------------------------------------------- CLI


def _plan_args(path: Path, *extra: str) -> list[str]:
    return ["plan", "--model", str(path), "--gpus", "8", "--gpu-memory", "80", "--seq-len", "256", "--batch", "16",
            *extra]


def test_cli_plans_dense_and_moe_configs(tmp_path, capsys):
    for config, name in ((TINY, "dense.json"), (TINY_MOE, "moe.json")):
        assert main(_plan_args(_write(tmp_path, config, name))) == 0
        out = capsys.readouterr().out
        assert "RECOMMENDED:" in out and "act:full" in out and "logit:chunk" in out
    assert main(_plan_args(tmp_path / "moe.json", "--json", "--compute-dtype", "bfloat16")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recommended"]["fits"] and report["model"]["num_experts"] == 8
    assert any(c["layout"]["ep"] > 1 for c in report["candidates"])
    assert report["recommended"]["memory"]["peak"] <= report["budget_bytes"]


def test_cli_bad_input_names_what_to_change(tmp_path, capsys):
    assert main(_plan_args(tmp_path / "missing.json")) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(_plan_args(_write(tmp_path, {**TINY, "architectures": ["MistralForCausalLM"]}))) == 2
    assert "unsupported architecture 'MistralForCausalLM'" in capsys.readouterr().err
    path = _write(tmp_path, TINY)
    assert main(["plan", "--model", str(path), "--gpus", "0", "--gpu-memory", "80", "--seq-len", "8",
                 "--batch", "4"]) == 2
    assert "--gpus must be a positive" in capsys.readouterr().err
    big = _write(tmp_path, json.loads((CONFIGS / "qwen3-8b.json").read_text()), "8b.json")
    assert main(["plan", "--model", str(big), "--gpus", "8", "--gpu-memory", "80", "--seq-len", "4096",
                 "--batch", "256", "--logprob-chunk-tokens", "0"]) == 2
    captured = capsys.readouterr()
    assert "NOTHING FITS" in captured.out and "--micro-batch" in captured.out and "no layout fits" in captured.err
    with pytest.raises(PlanInputError, match="lacks num_experts"):
        ModelShape.from_hf_dict({k: v for k, v in TINY_MOE.items() if k != "num_experts"})


def test_packed_table_equals_what_the_packed_forward_saves_beyond_the_plain_one():
    """PACKED_SAVED_BYTES: the packed forward (CPU: attention over a padded copy) saves exactly this
    much more per token per block than the plain forward, counted with saved_tensors_hooks."""
    from titanrl.models.packed_sequences import PackedSequences, packed_attention_layout
    from titanrl.planning.memory import PACKED_SAVED_BYTES

    config = Qwen3Config.from_hf_dict(TINY)
    shape = ModelShape.from_hf_dict(TINY)
    model = Qwen3ForCausalLM(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(forward) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        return sum(seen.values())

    B, T = 3, 10
    ids = torch.randint(0, config.vocab_size, (B, T))
    plain = saved(lambda: model(ids))
    with packed_attention_layout(model, PackedSequences.from_lengths([T] * B)):
        packed = saved(lambda: model(ids.reshape(1, -1), torch.arange(T).repeat(B)[None]))
    q = shape.num_attention_heads * shape.head_dim
    per_block = PACKED_SAVED_BYTES["q"] * 4 * q + PACKED_SAVED_BYTES["token"]
    assert packed - plain == B * T * shape.num_hidden_layers * per_block
