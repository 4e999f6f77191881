"""TitanRL: PyTorch-native GRPO post-training with vLLM rollouts in Ray actors.

    import titanrl
    config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint="ckpt/"), rewards=[my_reward], ...)
    result = titanrl.train(config)
"""

from titanrl.config import (
    ConfigError,
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    OutputConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)


def train(config: RunConfig):
    """Runs GRPO; see `titanrl.driver.train`."""
    from titanrl.driver import train as _train

    return _train(config)


__all__ = [
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "ModelConfig",
    "OutputConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "train",
]
