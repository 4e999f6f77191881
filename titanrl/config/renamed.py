"""Flat setting names from before the config had sections, and where each one went.

An old name given on the command line (`--train.lr=...`), as a constructor keyword
(`TrainConfig(lr=...)`) or as an attribute (`config.train.lr = ...`) is refused with its new
name, instead of being ignored or failing with a bare "unexpected keyword".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from titanrl.errors import ConfigError

RENAMED: dict[str, str] = {
    "train.lr": "train.optimizer.lr",
    "train.betas": "train.optimizer.betas",
    "train.weight_decay": "train.optimizer.weight_decay",
    "train.grad_clip": "train.optimizer.grad_clip",
    "train.warmup_steps": "train.lr_schedule.warmup_steps",
    "train.lr_decay": "train.lr_schedule.decay",
    "train.min_lr_ratio": "train.lr_schedule.min_lr_ratio",
    "train.loss": "train.loss.objective",
    "train.clip_eps": "train.loss.clip_eps",
    "train.clip_eps_high": "train.loss.clip_eps_high",
    "train.scale_advantages_by_std": "train.loss.scale_advantages_by_std",
    "train.loss_aggregation": "train.loss.aggregation",
    "train.entropy_coef": "train.loss.entropy_coef",
    "train.gspo_clip_eps": "train.loss.gspo_clip_eps",
    "train.loss_length_norm": "train.loss.length_norm",
    "train.kl_coef": "train.kl.coef",
    "train.kl_estimator": "train.kl.estimator",
    "train.kl_in_reward": "train.kl.in_reward",
    "train.decoupled_loss": "train.off_policy.decoupled_loss",
    "train.behaviour_weight_cap": "train.off_policy.behaviour_weight_cap",
    "train.off_policy_correction": "train.off_policy.correction",
    "train.off_policy_cap": "train.off_policy.cap",
    "train.off_policy_low": "train.off_policy.low",
    "train.router_replay": "train.moe.router_replay",
    "train.moe_load_balance": "train.moe.load_balance",
    "train.moe_aux_loss_coef": "train.moe.aux_loss_coef",
    "train.moe_bias_update_rate": "train.moe.bias_update_rate",
    "train.device": "train.compute.device",
    "train.compute_dtype": "train.compute.dtype",
    "train.threads": "train.compute.threads",
    "train.threads_when_rollouts_idle": "train.compute.threads_when_rollouts_idle",
    "train.cpu_matmul": "train.compute.cpu_matmul",
    "train.compile": "train.compute.compile",
    "train.pack_sequences": "train.compute.pack_sequences",
    "train.share_prompts": "train.compute.share_prompts",
    "train.xla_python": "train.compute.xla_python",
    "train.micro_batch_size": "train.memory.micro_batch_size",
    "train.logprob_chunk_tokens": "train.memory.logprob_chunk_tokens",
    "train.activation_checkpointing": "train.memory.activation_checkpointing",
    "train.activation_checkpointing_every": "train.memory.activation_checkpointing_every",
    "train.heap_mmap_threshold_mib": "train.memory.heap_mmap_threshold_mib",
    "rollout.temperature": "rollout.sampling.temperature",
    "rollout.top_p": "rollout.sampling.top_p",
    "rollout.top_k": "rollout.sampling.top_k",
    "rollout.max_new_tokens": "rollout.sampling.max_new_tokens",
    "rollout.logprobs": "rollout.sampling.logprobs",
    "rollout.max_model_len": "rollout.engine.max_model_len",
    "rollout.max_num_seqs": "rollout.engine.max_num_seqs",
    "rollout.kv_cache_gib": "rollout.engine.kv_cache_gib",
    "rollout.vllm_multiprocess": "rollout.engine.multiprocess",
    "rollout.vllm_kernels": "rollout.engine.vllm_kernels",
    "rollout.threads_per_worker": "rollout.engine.threads",
    "rollout.record_routed_experts": "rollout.engine.record_routed_experts",
    "rollout.dynamic_sampling": "rollout.shaping.dynamic_sampling",
    "rollout.dynamic_sampling_max_requests": "rollout.shaping.dynamic_sampling_max_requests",
    "rollout.overlong_filter": "rollout.shaping.overlong_filter",
    "rollout.overlong_buffer": "rollout.shaping.overlong_buffer",
    "rollout.overlong_penalty": "rollout.shaping.overlong_penalty",
    "rollout.reward_concurrency": "scoring.concurrency",
    "reward_timeout_s": "scoring.timeout_s",
    "reward_error_value": "scoring.error_value",
    "max_reward_error_frac": "scoring.max_error_frac",
    "reward_health": "scoring.health",
}
"""Old dotted key -> new dotted key (both as `--key=value` spells them)."""

SectionClass = TypeVar("SectionClass", bound=type)


def current_key(key: str, current_keys: set[str]) -> str:
    """`key` as the config spells it now: unchanged when it is one of `current_keys`, else with its
    longest old prefix (a renamed key, or a renamed section such as `reward_health`) replaced."""
    if key in current_keys:
        return key
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in RENAMED:
            return ".".join([RENAMED[head], *parts[i:]])
    return key


def renamed_message(old: str) -> str:
    """The refusal for an old dotted key."""
    return f"{old} was renamed to {RENAMED[old]} (the config has sections now: see docs/config-reference.md)"


def refuses_renamed(prefix: str) -> Callable[[SectionClass], SectionClass]:
    """Class decorator for the dataclass at `prefix` ('train.', 'rollout.', '' for RunConfig): an
    old field name passed to its constructor, set on it or read from it raises `ConfigError`
    (reads: `AttributeError`) naming the new key."""

    def decorate(cls: SectionClass) -> SectionClass:
        old_names = {key[len(prefix):] for key in RENAMED if key.startswith(prefix) and "." not in key[len(prefix):]}
        # 'train.loss' was the objective's name and is now its section: refused only for a non-section value.
        sections = {f.name for f in dataclasses.fields(cls)} & old_names
        init, setattr_ = cls.__init__, cls.__setattr__

        def refuse(name: str, value: Any) -> None:
            if name in old_names and not (name in sections and dataclasses.is_dataclass(value)):
                raise ConfigError(renamed_message(prefix + name))

        @functools.wraps(init)  # keeps the signature that tyro and help read
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for name, value in kwargs.items():
                refuse(name, value)
            init(self, *args, **kwargs)

        def __setattr__(self: Any, name: str, value: Any) -> None:
            refuse(name, value)
            setattr_(self, name, value)

        def __getattr__(self: Any, name: str) -> Any:  # only reached when normal lookup fails
            if name in old_names:
                raise AttributeError(renamed_message(prefix + name))
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        cls.__init__, cls.__setattr__, cls.__getattr__ = __init__, __setattr__, __getattr__
        return cls

    return decorate
