"""Typed run configuration, validated before any actor starts.

    from titanrl.config import RunConfig, TrainConfig, apply_overrides, validate
"""

from titanrl.config.schema import (
    ConfigError,
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    RewardFn,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    resolve_env_factory,
    resolve_reward,
    validate,
)

__all__ = [
    "ConfigError", "DataConfig", "EnvConfig", "EvalConfig", "ModelConfig", "OutputConfig", "ParallelConfig",
    "RewardFn", "RolloutConfig", "RunConfig", "TrainConfig", "apply_overrides", "resolve_env_factory",
    "resolve_reward", "validate",
]
