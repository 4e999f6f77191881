"""`TrainerSetup`: everything a trainer actor takes from the run, in one value.

`GRPOTrainer`, `TrainerGroup` and `ParallelTrainerRank` are built from one of these instead of
repeating the same argument list; the driver makes it from the resolved run config
(`ResolvedRunConfig.trainer_setup`), tests build it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanrl.config.schema import LoraConfig, ModelConfig, TrainConfig
from titanrl.trainer.truncation import Truncation


@dataclass(frozen=True)
class TrainerSetup:
    """The policy to start from, the `train` section, and the run-level settings the step needs."""

    model: ModelConfig
    """The run's `model` section: the checkpoint (HF directory or training checkpoint) and storage dtype."""
    train: TrainConfig
    """The run's `train` section, resolved."""
    temperature: float = 1.0
    """rollout.sampling.temperature: the trainer scores tokens under the generator's temperature."""
    seed: int = 0
    """The run's seed (torch's generator, before the model is built)."""
    batch_invariant: bool = False
    """Run the model and the logprobs through `titanrl.kernels`, matching a batch-invariant generator bit for bit."""
    truncation: Truncation | None = None
    """The generator's top-k / top-p when its logprobs are the truncated distribution's
    (`Truncation.scored_by_trainer(rollout)`); the trainer then scores tokens under it too."""
    device_type: str | None = None
    """'cpu', 'cuda' or 'xla': the device the run's placement reserved. None (a trainer built by
    hand) resolves train.compute.device on the trainer's own host ('auto': CUDA when present)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The run's `lora` section: low-rank adapters on the policy (rank 0: full fine-tuning)."""
