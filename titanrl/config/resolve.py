"""`resolve(config) -> ResolvedRunConfig`: the derived settings of a run, filled once, after validation.

Several settings mean "derived from the rest" when left at None; they used to be worked out inside
the actors that needed them. `resolve` fills them in one place, reading the checkpoint once
through its model spec, so the driver, the actors, `config.resolved.json` in the run directory and
`titanrl train CONFIG.py --print-config` all see the same values:

- `train.loss.length_norm` None: the longest completion a sample can have
  (`rollout.sampling.max_new_tokens`; `env.max_total_tokens` for environment runs);
- `rollout.engine.record_routed_experts` None: on for a mixture-of-experts checkpoint, off for a dense one
  (router replay trains on what the generator recorded);
- `rollout.sampling.logprobs`: what the engine returns. Untruncated sampling (top_k 0, top_p 1) makes
  'sampled' and 'raw' the same full softmax at the temperature, so it is 'sampled' there;
- `train.memory.heap_mmap_threshold_mib` None: by the policy's parameter count (1 MiB from 100M
  parameters, 32 below);
- after placement (`placed`, once Ray is up): the trainer's device (`train.compute.device` 'auto'
  against the GPUs Ray has) and `rollout.weight_transport` ('auto' against the cluster and
  /dev/shm);
- `generator_dtype`: the dtype the generators compute in (the trainer's compute dtype, which the
  pushed weights arrive in);
- then `titanrl.planning.fit.with_memory_plan` chooses the `auto` memory settings
  (train.memory.activation_checkpointing and micro_batch_size, rollout.engine.vllm_kernels and
  kv_cache_gib) from the memory plan, or refuses the run; `ResolvedRunConfig.memory` keeps the plan.

`ResolvedRunConfig.model` records what the checkpoint is (family, size), so a printed config
says which model a run trains without opening the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from titanrl.config.record import config_record
from titanrl.config.schema import RolloutConfig, RunConfig, TrainConfig
from titanrl.memory import auto_heap_mmap_threshold_mib


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
    trainer_device: str | None = None
    """'cpu', 'cuda' or 'xla': what the run's placement reserved for the trainer (`placed`); None
    until Ray has started (`--print-config` shows the config before that)."""
    memory: dict[str, Any] | None = None
    """The memory plan the `auto` memory settings were chosen from (`titanrl.planning.fit.MemoryFit.record`:
    the settings, each actor's estimate by term, the node's budget); None when not planned."""
    memory_summary: tuple[str, ...] = ()
    """What start-up prints about memory: the plan's lines, or why there is none."""

    def placed(self, trainer_device: str, weight_transport: str) -> ResolvedRunConfig:
        """This config once the cluster is known: the trainer's device and the concrete weight
        transport (`rollout.weight_transport` 'auto' chosen by `titanrl.driver.weight_transport`)."""
        rollout = dataclasses.replace(self.config.rollout, weight_transport=weight_transport)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, rollout=rollout),
                                   trainer_device=trainer_device)

    @property
    def generator_dtype(self) -> str:
        """The dtype the rollout engines compute in (RunConfig.generator_dtype)."""
        return self.config.generator_dtype

    def record(self) -> dict[str, Any]:
        """JSON-ready: the config as `config.json` records it, plus the model facts."""
        memory = self.memory if self.memory is not None else {"planned": False, "why": " ".join(self.memory_summary)}
        return {**config_record(self.config), "resolved": {"model": dataclasses.asdict(self.model),
                                                           "generator_dtype": self.generator_dtype,
                                                           "trainer_device": self.trainer_device,
                                                           "memory": memory}}

    def to_json(self) -> str:
        return json.dumps(self.record(), indent=2) + "\n"


def loss_length_norm(config: RunConfig) -> int:
    """train.loss.length_norm, or when None the longest completion a sample can have."""
    if config.train.loss.length_norm is not None:
        return config.train.loss.length_norm
    return episode_completion_tokens(config) if config.runs_episodes else config.rollout.sampling.max_new_tokens


def episode_completion_tokens(config: RunConfig) -> int:
    """The longest completion side an episode can have: env.max_total_tokens for an environment; for
    an agent, whose calls each fit the engine's context, rollout.engine.max_model_len."""
    if config.env.factory is not None:
        return config.env.max_total_tokens
    return config.rollout.engine.max_model_len


def records_routed_experts(rollout: RolloutConfig, is_moe: bool) -> bool:
    """rollout.engine.record_routed_experts, or when None whether the policy is a mixture of experts."""
    return is_moe if rollout.engine.record_routed_experts is None else bool(rollout.engine.record_routed_experts)


def engine_logprobs(rollout: RolloutConfig) -> Literal["sampled", "raw"]:
    """The logprobs the engine returns: rollout.sampling.logprobs, 'sampled' when nothing is truncated
    (both modes are then the full softmax at the temperature)."""
    return rollout.sampling.logprobs if rollout.sampling.top_k > 0 or rollout.sampling.top_p < 1 else "sampled"


def heap_mmap_threshold_mib(train: TrainConfig, parameters: int) -> int:
    """train.memory.heap_mmap_threshold_mib, or when None the policy size's value
    (`titanrl.memory.auto_heap_mmap_threshold_mib`)."""
    threshold = train.memory.heap_mmap_threshold_mib
    return auto_heap_mmap_threshold_mib(parameters) if threshold is None else threshold


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
    """`config` (already validated) with its derived settings filled, and what its checkpoint holds.
    Its `auto` memory settings are still 'auto': `titanrl.planning.fit.with_memory_plan` chooses them."""
    facts = model_facts(config.model.checkpoint)
    rc, tc = config.rollout, config.train
    engine = dataclasses.replace(rc.engine, record_routed_experts=records_routed_experts(rc, facts.is_moe))
    sampling = dataclasses.replace(rc.sampling, logprobs=engine_logprobs(rc))
    rollout = dataclasses.replace(rc, engine=engine, sampling=sampling)
    memory = dataclasses.replace(tc.memory, heap_mmap_threshold_mib=heap_mmap_threshold_mib(tc, facts.parameters))
    train = dataclasses.replace(tc, loss=dataclasses.replace(tc.loss, length_norm=loss_length_norm(config)),
                                memory=memory)
    return ResolvedRunConfig(config=dataclasses.replace(config, rollout=rollout, train=train), model=facts)
