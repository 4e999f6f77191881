"""`titanrl.config.resolve`: derived settings filled once, and `titanrl train --print-config`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import titanrl
from titanrl.config import validate
from titanrl.config.resolve import ResolvedRunConfig, resolve
from titanrl.models.architectures import build_model
from titanrl.models.hf_checkpoint import read_config
from titanrl.models.tiny import write_tiny_checkpoint, write_tiny_moe_checkpoint


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "ckpt")


def _config(checkpoint, tmp_path, **sampling) -> titanrl.RunConfig:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(checkpoint)),
        data=titanrl.DataConfig(train_file=str(rows)),
        rollout=titanrl.RolloutConfig(prompts_per_step=2, group_size=2,
                                      sampling=titanrl.SamplingConfig(max_new_tokens=12, **sampling)),
        rewards=["titanrl.rewards:exact_match"],
    )


def test_derived_values_are_filled_from_the_checkpoint(dense, moe, tmp_path):
    """None means derived: the length norm is max_new_tokens, routing is recorded for MoE only;
    untruncated 'raw' logprobs are the engine's 'sampled'; an explicit value is kept."""
    config = _config(dense, tmp_path, logprobs="raw")
    validate(config)
    resolved = resolve(config)
    assert resolved.config.train.loss.length_norm == 12
    assert resolved.config.rollout.engine.record_routed_experts is False
    assert resolved.config.rollout.sampling.logprobs == "sampled"
    assert resolved.config.train.memory.heap_mmap_threshold_mib == 32  # a tiny policy: the fast threshold
    assert config.train.loss.length_norm is None  # the user's config is left as given
    assert resolved.trainer_device is None  # placed once Ray is up
    placed = resolved.placed("cpu", "object_store")
    assert (placed.trainer_device, placed.config.rollout.weight_transport) == ("cpu", "object_store")
    assert placed.record()["resolved"]["trainer_device"] == "cpu"

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(read_config(dense)).parameters())
    assert resolved.model.family == "qwen3" and not resolved.model.is_moe and resolved.model.parameters == params

    moe_resolved = resolve(_config(moe, tmp_path, top_p=0.9, logprobs="raw"))
    assert moe_resolved.model.is_moe and moe_resolved.config.rollout.engine.record_routed_experts is True
    assert moe_resolved.config.rollout.sampling.logprobs == "raw"  # truncated: the setting matters, kept

    explicit = _config(dense, tmp_path)
    explicit.train.loss.length_norm = 5
    assert resolve(explicit).config.train.loss.length_norm == 5

    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.config = config  # type: ignore[misc]
    assert isinstance(resolved, ResolvedRunConfig)


def test_print_config_prints_the_resolved_config_without_ray(dense, tmp_path, capsys, monkeypatch):
    """`titanrl train CONFIG.py --print-config` validates, resolves, prints JSON and starts nothing."""
    import titanrl.driver.train
    from titanrl.cli import main

    def no_run(*args, **kwargs):
        raise AssertionError("--print-config started a run")

    monkeypatch.setattr(titanrl.driver.train, "train", no_run)
    monkeypatch.setattr(titanrl.driver.train, "init_ray", no_run)

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    config_file = tmp_path / "config.py"
    config_file.write_text(
        "import titanrl\n"
        f"config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint={str(dense)!r}),\n"
        f"    data=titanrl.DataConfig(train_file={str(tmp_path / 'rows.jsonl')!r}),\n"
        "    rollout=titanrl.RolloutConfig(prompts_per_step=2, group_size=2), rewards=['titanrl.rewards:exact_match'])\n"
    )
    assert main(["train", str(config_file), "--print-config", "--rollout.sampling.max_new_tokens=9",
                 f"--output.dir={tmp_path / 'run'}"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["loss"]["length_norm"] == 9 and printed["rollout"]["sampling"]["max_new_tokens"] == 9
    assert printed["resolved"]["model"]["architecture"] == "Qwen3ForCausalLM"
    assert not (tmp_path / "run").exists()
