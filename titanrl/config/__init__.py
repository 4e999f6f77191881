"""Typed run configuration, validated before any actor starts.

    from titanrl.config import RunConfig, TrainConfig, apply_overrides, validate

`schema` holds the dataclasses (a leaf), `overrides` the CLI `section.key=value` parsing (tyro),
`values` the text form of a value, `validation` the checks run before any actor starts, `help`
the `titanrl train --help` text (tyro's, from the fields' docstrings).
`ConfigError` lives in `titanrl.errors`; it is re-exported here for users.
"""

from titanrl.config.overrides import apply_overrides
from titanrl.config.schema import (
    AgentConfig,
    ClusterConfig,
    ComputeConfig,
    DataConfig,
    EngineConfig,
    EnvConfig,
    EvalConfig,
    KlConfig,
    LoraConfig,
    LossConfig,
    LrScheduleConfig,
    MemoryConfig,
    ModelConfig,
    MoeConfig,
    OffPolicyConfig,
    OptimizerConfig,
    OutputConfig,
    ParallelConfig,
    RewardFn,
    RewardHealthConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    ScoringConfig,
    ShapingConfig,
    TrainConfig,
)
from titanrl.config.validation import resolve_agent_fn, resolve_env_factory, resolve_reward, validate
from titanrl.errors import ConfigError

__all__ = [
    "AgentConfig",
    "ClusterConfig",
    "ComputeConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "EnvConfig",
    "EvalConfig",
    "KlConfig",
    "LoraConfig",
    "LossConfig",
    "LrScheduleConfig",
    "MemoryConfig",
    "ModelConfig",
    "MoeConfig",
    "OffPolicyConfig",
    "OptimizerConfig",
    "OutputConfig",
    "ParallelConfig",
    "RewardFn",
    "RewardHealthConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "ScoringConfig",
    "ShapingConfig",
    "TrainConfig",
    "apply_overrides",
    "resolve_agent_fn",
    "resolve_env_factory",
    "resolve_reward",
    "validate",
]
