"""`auto` memory settings chosen from the memory plan (titanrl/planning/fit.py), before start-up.

The budgets here are synthetic (`NodeMemory` built by hand), so each test knows exactly what
fits; the estimates themselves are `titanrl.planning`'s (checked against measured peaks by
benchmarks/actor_memory.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

import titanrl
from titanrl.config import validate
from titanrl.config.resolve import resolve
from titanrl.errors import ConfigError
from titanrl.models.tiny import write_tiny_checkpoint
from titanrl.planning.fit import (
    RAY_PROCESSES_BYTES,
    NodeMemory,
    _candidates,
    fit_memory,
    kv_sizes_gib,
    layout_of,
    plan_memory,
    trainer_options,
    with_memory_plan,
)
from titanrl.planning.memory import GiB
from titanrl.planning.shape import ModelShape
from titanrl.planning.worker_memory import estimate_worker, kv_bytes_per_token

QWEN3_0_6B = "examples/configs/qwen3-0.6b.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _config(checkpoint, tmp_path, **memory) -> titanrl.RunConfig:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    config = titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(checkpoint)),
        data=titanrl.DataConfig(train_file=str(rows)),
        rollout=titanrl.RolloutConfig(prompts_per_step=4, group_size=4,
                                      sampling=titanrl.SamplingConfig(max_new_tokens=128),
                                      engine=titanrl.EngineConfig(max_model_len=256)),
        rewards=["titanrl.rewards:exact_match"],
    )
    config.train.memory = dataclasses.replace(config.train.memory, **memory)
    return config


def node_with_budget(budget_gib: float) -> NodeMemory:
    """A node whose `budget` is `budget_gib` (nothing else in use)."""
    total = int((budget_gib * GiB + RAY_PROCESSES_BYTES) / 0.90) + 1
    return NodeMemory(total=total, in_use=0, kill_fraction=0.95)


def qwen3_config(tmp_path, **memory) -> tuple[titanrl.RunConfig, ModelShape]:
    """The issue's Qwen3-0.6B run (4 prompts x 4 samples, 256-token sequences), planned from the shape alone."""
    return _config("unused", tmp_path, **memory), ModelShape.from_config_json(QWEN3_0_6B)


def test_a_tiny_model_gets_the_fast_settings(tiny, tmp_path):
    """Room to spare: no checkpointing, the whole batch in one micro-batch, vLLM's kernels, 1 GiB of KV."""
    config = _config(tiny, tmp_path)
    validate(config)
    resolved = with_memory_plan(resolve(config), node_with_budget(20))
    m, e = resolved.config.train.memory, resolved.config.rollout.engine
    assert (m.activation_checkpointing, m.micro_batch_size) == ("none", 16)
    assert (e.vllm_kernels, e.kv_cache_gib) == (True, 1.0)
    assert resolved.memory is not None and resolved.memory["fits"]
    assert set(resolved.memory["auto"]) == {"train.memory.activation_checkpointing", "train.memory.micro_batch_size",
                                         "rollout.engine.vllm_kernels", "rollout.engine.kv_cache_gib"}
    lines = resolved.memory_summary
    assert len(lines) == 3 and "micro_batch_size=16 (auto)" in lines[0] and "kv_cache_gib=1.0 (auto)" in lines[1]
    record = resolved.record()["resolved"]["memory"]
    assert record["settings"]["train.memory.micro_batch_size"] == 16 and record["fits"] is True
    assert config.train.memory.micro_batch_size == "auto"  # the user's config is left as given


def test_a_squeezed_budget_gets_checkpointing_and_smaller_micro_batches(tmp_path):
    """Qwen3-0.6B's shape with 2048-token sequences (activations dominate) against budgets from 40
    GiB down: the choice walks down the documented order, and each choice is the first candidate
    that fits (every faster one does not)."""
    config, shape = qwen3_config(tmp_path)
    config.rollout.engine = dataclasses.replace(config.rollout.engine, max_model_len=2048)
    chosen = []
    for quarter_gib in range(160, 60, -1):
        node = node_with_budget(quarter_gib / 4)
        fit = fit_memory(config, shape, node)
        if not fit.fits:
            break
        assert fit.total <= node.budget
        for candidate in _candidates(config, shape, node):
            if candidate.settings() == fit.settings():
                break
            assert not candidate.fits
        option = (fit.trainer_option.activation_checkpointing, fit.trainer_option.micro_batch_size,
                  fit.worker_option.vllm_kernels, fit.worker_option.kv_cache_gib)
        if not chosen or chosen[-1] != option:
            chosen.append(option)
    # 40 GiB: no checkpointing, vLLM's kernels, KV for 16 sequences of 2048 tokens (7 GiB); the
    # whole batch's activations (16 x 2048 tokens, ~117 GiB) do not fit, 2 sequences do.
    assert chosen[0] == ("none", 2, True, 7.0)
    assert ("none", 1, True, 7.0) in chosen  # micro-batches halved before checkpointing
    assert any(mode == "full" for mode, *_ in chosen)  # then every block checkpointed
    assert chosen[-1][2:] != (True, 7.0)  # the workers give up speed last
    modes = [mode for mode, *_ in chosen]
    assert modes == sorted(modes, key=["none", "full"].index)  # never back to no checkpointing


def test_the_trainer_order_is_no_checkpointing_first_then_halving_micro_batches(tmp_path):
    config, _ = qwen3_config(tmp_path)
    options = trainer_options(config, layout_of(config))
    assert [(o.activation_checkpointing, o.micro_batch_size) for o in options] == [
        ("none", 16), ("none", 8), ("none", 4), ("none", 2), ("none", 1),
        ("full", 16), ("full", 8), ("full", 4), ("full", 2), ("full", 1)]


def test_kv_cache_sizes_hold_the_workers_share_then_shrink_to_one_sequence(tmp_path):
    """Whole GiB (vLLM's CPU cache size is an integer): the worker's share of the step's sequences,
    then halvings down to what one max_model_len sequence needs."""
    config, shape = qwen3_config(tmp_path)
    per_sequence = 256 * kv_bytes_per_token(shape, "float32") / GiB  # 0.055 GiB
    assert kv_sizes_gib(config, shape, "float32") == [1.0]  # 16 x 0.055 GiB: one GiB holds them all
    config.rollout.engine = dataclasses.replace(config.rollout.engine, max_model_len=8192)
    config.rollout.prompts_per_step = 8
    sizes = kv_sizes_gib(config, shape, "float32")  # 32 sequences of 8192 tokens: 56 GiB, one of them 1.75
    assert sizes[0] == 56.0 and sizes[-1] == 2.0 >= 8192 / 256 * per_sequence
    assert sizes == sorted(sizes, reverse=True) and all(s == int(s) for s in sizes)


def test_an_explicit_value_is_never_overridden_and_a_misfit_warns(tmp_path, caplog):
    """micro_batch_size=16 without checkpointing on Qwen3-0.6B cannot fit a 12 GiB budget: the run
    keeps it (and the other explicit value), the rest is still chosen, and a warning names the numbers."""
    config, shape = qwen3_config(tmp_path, micro_batch_size=16, activation_checkpointing="none")
    fit = fit_memory(config, shape, node_with_budget(12))
    assert not fit.fits
    assert (fit.trainer_option.micro_batch_size, fit.trainer_option.activation_checkpointing) == (16, "none")
    assert fit.auto == ("rollout.engine.vllm_kernels", "rollout.engine.kv_cache_gib")
    assert fit.worker_option == dataclasses.replace(fit.worker_option, vllm_kernels=False, kv_cache_gib=1.0)
    warning = fit.warning()
    assert f"{fit.total / GiB:.1f} GiB against a budget of 12.0 GiB" in warning
    assert "train.memory.activation_checkpointing, train.memory.micro_batch_size are kept" in warning


def test_plan_memory_keeps_explicit_values_and_logs_the_warning(tiny, tmp_path, caplog):
    config = _config(tiny, tmp_path, micro_batch_size=3, activation_checkpointing="full")
    config.rollout.engine = dataclasses.replace(config.rollout.engine, kv_cache_gib=2.0, vllm_kernels=False)
    with caplog.at_level(logging.WARNING, logger="titanrl"):
        planned, fit, _ = plan_memory(config, node_with_budget(0.5))  # nothing fits 0.5 GiB
    assert not fit.fits and "does not fit" in caplog.text
    m, e = planned.train.memory, planned.rollout.engine
    assert (m.micro_batch_size, m.activation_checkpointing, e.kv_cache_gib, e.vllm_kernels) == (3, "full", 2.0, False)


def test_a_run_that_cannot_fit_is_refused_before_start_up_naming_the_numbers(tmp_path):
    config, shape = qwen3_config(tmp_path)
    node = node_with_budget(17)
    fit = fit_memory(config, shape, node)
    assert not fit.fits and len(fit.auto) == 4
    # resolve() itself, on a checkpoint of the same shape: the refusal is a ConfigError.
    ckpt = tmp_path / "qwen3-0.6b-config-only"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(open(QWEN3_0_6B).read())
    config.model.checkpoint = str(ckpt)
    with pytest.raises(ConfigError) as refused:
        plan_memory(config, node)
    message = str(refused.value)
    assert f"estimates {fit.total / GiB:.1f} GiB against a budget of 17.0 GiB" in message
    assert "activation_checkpointing=full (auto), micro_batch_size=1 (auto)" in message  # the smallest tried
    assert "What would fit: train.compute.dtype=bfloat16" in message


def test_a_run_that_fits_nothing_names_the_memory_it_needs(tmp_path):
    config, shape = qwen3_config(tmp_path)
    fit = fit_memory(config, shape, node_with_budget(4))
    assert "No single change would fit: a node with at least" in fit.refusal([])
    assert fit.needed_node_gib() > fit.total / GiB


def test_the_worker_estimate_counts_packed_copies_only_with_vllm_kernels():
    shape = ModelShape.from_config_json(QWEN3_0_6B)
    on = estimate_worker(shape, dtype="float32", kv_cache_bytes=GiB, max_num_seqs=16, vllm_kernels=True)
    off = estimate_worker(shape, dtype="float32", kv_cache_bytes=GiB, max_num_seqs=16, vllm_kernels=False)
    embedding = shape.vocab_size * shape.hidden_size
    assert off.packed == 0 and on.weights == 4 * shape.total_params
    # Every decoder linear, no embedding and no norms: 440M of Qwen3-0.6B's 596M parameters.
    assert 4 * (shape.total_params - embedding) > on.packed > 4 * (shape.total_params - embedding) * 0.99
    assert on.peak - off.peak == on.packed


def test_sequences_are_planned_at_the_longest_prompt_plus_max_new_tokens(tiny, tmp_path):
    """The driver counts the prompts: the plan's sequences are the longest prompt + max_new_tokens
    (not max_model_len), and a run with longer prompts is planned longer."""
    from titanrl.data import load_run_rows, load_tokenizer, longest_prompt_tokens
    from titanrl.planning.fit import planned_seq_len

    config = _config(tiny, tmp_path)
    rows, _ = load_run_rows(config)
    longest = longest_prompt_tokens(config, rows)
    tokenizer = load_tokenizer(str(tiny))
    assert longest == max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows) > 0
    assert planned_seq_len(config, longest) == longest + 128 < 256
    assert planned_seq_len(config) == 256  # prompts not counted: max_model_len bounds a sequence
    shape = ModelShape.from_config_json(str(tiny))
    short = fit_memory(config, shape, node_with_budget(20), longest)
    assert short.seq_len == longest + 128 and short.trainer.peak < fit_memory(config, shape, node_with_budget(20)).trainer.peak


def test_a_lora_plan_counts_adapter_state_and_the_merged_copies(tiny, tmp_path):
    """LoRA (rank 8): the plan's adapter elements equal the adapters a real model gets; gradients and
    AdamW state cover those alone; the merged form (lora.sync='merged') holds one block's merged
    copies at most, the unmerged form none; a worker taking adapter pushes packs its frozen base
    for vLLM's kernels as a full fine-tuning run's worker does. At Qwen3-0.6B's shape: 5,046,272 adapter elements, as benchmarks/lora.py counts
    trainable parameters."""
    from titanrl.models.common.lora import adapter_parameters, add_adapters
    from titanrl.models.hf_checkpoint import load_model
    from titanrl.planning.fit import lora_elements, trainer_workload
    from titanrl.planning.memory import estimate

    config = _config(tiny, tmp_path)
    config.lora = titanrl.LoraConfig(rank=8, sync="merged")
    model, _ = load_model(str(tiny))
    add_adapters(model, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 8, 16.0)
    shape = ModelShape.from_config_json(tiny / "config.json")
    adapters, merged = lora_elements(config, shape)
    assert adapters == sum(p.numel() for p in adapter_parameters(model).values())
    block = model.model.layers[0]
    assert merged == sum(m.base_weight.numel() for m in block.modules() if hasattr(m, "base_weight"))
    config.lora = titanrl.LoraConfig(rank=8)  # sync='adapter': the unmerged form
    assert lora_elements(config, shape) == (adapters, 0)

    qwen, qwen_shape = qwen3_config(tmp_path)
    qwen.lora = titanrl.LoraConfig(rank=8, sync="merged")
    assert lora_elements(qwen, qwen_shape)[0] == 5_046_272
    full = estimate(qwen_shape, layout_of(qwen), trainer_workload(qwen))
    lora = estimate(qwen_shape, layout_of(qwen), trainer_workload(qwen, shape=qwen_shape))
    assert lora.optimizer_state == 8 * 5_046_272 and lora.gradients == 4 * 5_046_272
    assert lora.activations_checkpointed - full.activations_checkpointed == 4 * lora_elements(qwen, qwen_shape)[1]
    assert lora.activations_stored == full.activations_stored
    qwen.lora = titanrl.LoraConfig(rank=8)  # a worker taking adapter pushes packs its frozen base as any
    lora_worker = next(_candidates(qwen, qwen_shape, node_with_budget(64))).worker
    qwen.lora = titanrl.LoraConfig()
    assert lora_worker.packed == next(_candidates(qwen, qwen_shape, node_with_budget(64))).worker.packed > 0
