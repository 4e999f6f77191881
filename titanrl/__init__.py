"""TitanRL: PyTorch-native GRPO post-training with vLLM rollouts in Ray actors.

    import titanrl
    config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint="ckpt/"), rewards=[my_reward], ...)
    result = titanrl.train(config)
"""

from titanrl.config import (
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    RewardHealthConfig,
    RolloutConfig,
    RunConfig,
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
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "ModelConfig",
    "OutputConfig",
    "ParallelConfig",
    "RewardHealthConfig",
    "RolloutConfig",
    "RunConfig",
    "RunStopped",
    "TrainConfig",
    "batched_reward",
    "train",
]
