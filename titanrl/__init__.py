"""TitanRL: PyTorch-native GRPO post-training with vLLM rollouts in Ray actors.

    import titanrl
    config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint="ckpt/"), rewards=[my_reward], ...)
    result = titanrl.train(config)
"""

from titanrl.config import (
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
    RewardHealthConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    ScoringConfig,
    ShapingConfig,
    TrainConfig,
)
from titanrl.errors import ConfigError, RunStopped
from titanrl.rewards.batched import batched_reward


def train(config: RunConfig, resume: bool = False):
    """Runs GRPO; with `resume=True` continues the run in `config.output.dir` from its newest
    training checkpoint. See `titanrl.driver.train.train`."""
    from titanrl.driver.train import train as _train

    return _train(config, resume=resume)


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
    "RewardHealthConfig",
    "RolloutConfig",
    "RunConfig",
    "RunStopped",
    "SamplingConfig",
    "ScoringConfig",
    "ShapingConfig",
    "TrainConfig",
    "batched_reward",
    "train",
]
