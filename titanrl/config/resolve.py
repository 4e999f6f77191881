"""`resolve(config) -> ResolvedRunConfig`: the derived settings of a run, filled once, after validation.

Several settings mean "derived from the rest" when left at None; they used to be worked out inside
the actors that needed them. `resolve` fills them in one place, reading the checkpoint once
through its model spec, so the driver, the actors, `config.resolved.json` in the run directory and
`titanrl train CONFIG.py --print-config` all see the same values:

- `train.loss_length_norm` None: the longest completion a sample can have
  (`rollout.max_new_tokens`; `env.max_total_tokens` for environment runs);
- `rollout.record_routed_experts` None: on for a mixture-of-experts checkpoint, off for a dense one
  (router replay trains on what the generator recorded);
- `rollout.logprobs`: what the engine returns. Untruncated sampling (top_k 0, top_p 1) makes
  'sampled' and 'raw' the same full softmax at the temperature, so it is 'sampled' there;
- `generator_dtype`: the dtype the generators compute in (the trainer's compute dtype, which the
  pushed weights arrive in).

`ResolvedRunConfig.model` records what the checkpoint is (family, size), so a printed config
says which model a run trains without opening the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from titanrl.config.record import config_record
from titanrl.config.schema import RolloutConfig, RunConfig


@dataclass(frozen=True)
class ModelFacts:
    """What the checkpoint holds, read once through its model spec."""

    architecture: str
    """`architectures[0]` of the checkpoint's config.json (the key of `titanrl.models.architectures.SPECS`)."""
    family: str
    """The model spec's name."""
    is_moe: bool
    """Whether the model has mixture-of-experts layers."""
    parameters: int
    """Parameter count (embeddings included; a tied head counted once)."""
    layers: int
    """Decoder layers."""
    hidden_size: int
    """Width of the residual stream."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""


@dataclass(frozen=True)
class ResolvedRunConfig:
    """A validated RunConfig with every derived value filled (see the module docstring)."""

    config: RunConfig
    """The run's config; its derived fields hold their resolved values."""
    model: ModelFacts
    """What model.checkpoint holds."""

    @property
    def generator_dtype(self) -> str:
        """The dtype the rollout engines compute in (RunConfig.generator_dtype)."""
        return self.config.generator_dtype

    def record(self) -> dict[str, Any]:
        """JSON-ready: the config as `config.json` records it, plus the model facts."""
        return {**config_record(self.config), "resolved": {"model": dataclasses.asdict(self.model),
                                                           "generator_dtype": self.generator_dtype}}

    def to_json(self) -> str:
        return json.dumps(self.record(), indent=2) + "\n"


def loss_length_norm(config: RunConfig) -> int:
    """train.loss_length_norm, or when None the longest completion a sample can have."""
    if config.train.loss_length_norm is not None:
        return config.train.loss_length_norm
    return config.env.max_total_tokens if config.env.factory is not None else config.rollout.max_new_tokens


def records_routed_experts(rollout: RolloutConfig, is_moe: bool) -> bool:
    """rollout.record_routed_experts, or when None whether the policy is a mixture of experts."""
    return is_moe if rollout.record_routed_experts is None else bool(rollout.record_routed_experts)


def engine_logprobs(rollout: RolloutConfig) -> str:
    """The logprobs the engine returns: rollout.logprobs, 'sampled' when nothing is truncated
    (both modes are then the full softmax at the temperature)."""
    return rollout.logprobs if rollout.top_k > 0 or rollout.top_p < 1 else "sampled"


def model_facts(checkpoint: str) -> ModelFacts:
    """The checkpoint's architecture, family and size (the model is built on the meta device)."""
    import torch

    from titanrl.models.architectures import build_model, spec_for
    from titanrl.models.hf_checkpoint import read_config

    model_config = read_config(checkpoint)
    spec = spec_for(model_config)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(model_config).parameters())
    return ModelFacts(architecture=model_config.HF_ARCHITECTURE, family=spec.name, is_moe=spec.is_moe,
                      parameters=parameters, layers=model_config.num_hidden_layers,
                      hidden_size=model_config.hidden_size, vocab_size=model_config.vocab_size)


def resolve(config: RunConfig) -> ResolvedRunConfig:
    """`config` (already validated) with its derived settings filled, and what its checkpoint holds."""
    facts = model_facts(config.model.checkpoint)
    rollout = dataclasses.replace(config.rollout, record_routed_experts=records_routed_experts(config.rollout, facts.is_moe),
                                  logprobs=engine_logprobs(config.rollout))
    train = dataclasses.replace(config.train, loss_length_norm=loss_length_norm(config))
    return ResolvedRunConfig(config=dataclasses.replace(config, rollout=rollout, train=train), model=facts)
