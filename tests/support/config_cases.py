"""A valid run config on a real tiny checkpoint, and the assertion that a config fails validation
naming the field: the config-validation tests share them (fixtures imported by name)."""

from __future__ import annotations

import pytest

from titanrl.config import ConfigError, DataConfig, ModelConfig, RunConfig, validate


def length_reward(prompt: str, completion: str, **fields) -> float:
    """An importable module-level reward ('support.config_cases:length_reward' style)."""
    return float(len(completion))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A real tiny checkpoint directory (config, weights, tokenizer)."""
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def good_config(tmp_path, checkpoint_dir) -> RunConfig:
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return RunConfig(
        model=ModelConfig(checkpoint=str(checkpoint_dir)),
        data=DataConfig(train_file=str(train)),
        rewards=[length_reward],
    )


def fails_validation(config: RunConfig, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(config)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg
