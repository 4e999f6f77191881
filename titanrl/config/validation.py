"""Checks a whole RunConfig before any actor starts: types, ranges, paths, callables, and the
trainer's layout against the model. Raises `ConfigError` naming the field and what to change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titanrl.config.values import check_type, type_name
from titanrl.config.schema import LoraConfig, RewardFn, RunConfig, TrainConfig
from titanrl.config.xla_env import validate_xla
from titanrl.errors import ConfigError


def _check_types(obj: Any, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_types(value, f"{name}.")
        elif not check_type(value, hints[f.name]):
            raise ConfigError(
                f"{name} must be {type_name(hints[f.name])}, got {type(value).__name__} {value!r}"
            )


def _import_callable(spec: Any, field_name: str, example: str, signature: str) -> Callable[..., Any]:
    """A callable, or one named by a 'package.module:attribute' string."""
    if isinstance(spec, str):
        import importlib

        module_name, _, attr = spec.partition(":")
        try:
            spec = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"{field_name}={spec!r} cannot be imported ({e}); use '{example}'") from e
    if not callable(spec):
        raise ConfigError(f"{field_name} must be callable as {signature}, got {type(spec).__name__} {spec!r}")
    return spec


def resolve_reward(spec: Any, index: int) -> RewardFn:
    """Turns a callable or a 'module:function' string into a reward callable."""
    return _import_callable(
        spec, f"rewards[{index}]", "package.module:function", "reward(prompt, completion, **row_fields) -> float"
    )


def resolve_env_factory(spec: Any) -> Callable[..., Any]:
    """Turns a callable or a 'module:function' string into an environment factory."""
    return _import_callable(spec, "env.factory", "package.module:make_env", "make_env(context) -> Environment")


def resolve_agent_fn(spec: Any) -> Callable[..., Any]:
    """Turns a callable or a 'module:function' string into an agent function, checking that it
    takes (base_url, api_key, row)."""
    import inspect

    fn = _import_callable(spec, "agent.fn", "package.module:agent", "agent(base_url, api_key, row) -> float")
    try:
        inspect.signature(fn).bind("http://127.0.0.1:1/v1", "key", {})
    except TypeError as e:
        raise ConfigError(f"agent.fn={spec!r} cannot be called as agent(base_url, api_key, row) ({e})") from e
    except ValueError:
        pass  # no signature to read (a builtin): the first episode will tell
    return fn


def _validate_agent(config: RunConfig) -> None:
    """agent.*: an agent replaces the environment and the reward functions (it returns the reward)."""
    agent = config.agent
    resolve_agent_fn(agent.fn)
    if config.env.factory is not None:
        raise ConfigError("agent.fn and env.factory are both set: an episode is either an environment's or an "
                          "agent's; set one of them to None")
    if config.rewards:
        raise ConfigError("rewards is set, but agent.fn returns each episode's reward itself: set rewards=[] "
                          "and compute every reward term inside the agent")
    if config.data.messages_field:
        raise ConfigError("data.messages_field renders single-turn prompts, but agent.fn is set (the agent writes "
                          "its own messages from the row): set data.messages_field=''")
    if config.rollout.shaping.overlong_buffer > 0:
        raise ConfigError("rollout.shaping.overlong_buffer is for single-turn rollouts; with agent.fn set, "
                          "put a length penalty into the agent's reward and set it to 0")
    _positive(config, "agent.timeout_s", "agent.max_calls", "agent.max_request_bytes")
    if agent.sandbox_pool_size < 0:
        raise ConfigError("agent.sandbox_pool_size must be >= 0")
    if agent.chat_template is not None and not Path(agent.chat_template).is_file():
        raise ConfigError(f"agent.chat_template: {agent.chat_template!r} is not a file (a Jinja chat template)")
    if not agent.served_model_name:
        raise ConfigError("agent.served_model_name is empty: requests must name a model")


def _dotted(config: RunConfig, dotted: str) -> Any:
    """The value at a dotted key ('train.optimizer.lr')."""
    return functools.reduce(getattr, dotted.split("."), config)


def _positive(config: RunConfig, *dotted: str) -> None:
    for d in dotted:
        value = _dotted(config, d)
        if value != "auto" and value <= 0:  # 'auto': a memory setting the plan resolves
            raise ConfigError(f"{d} must be > 0, got {value}")


def validate(config: RunConfig) -> None:
    """Raises ConfigError for anything that would fail later, before any actor starts."""
    if not isinstance(config, RunConfig):
        raise ConfigError(f"expected a titanrl.RunConfig, got {type(config).__name__}")
    _check_types(config, "")
    _positive(
        config,
        "rollout.num_workers", "rollout.prompts_per_step", "rollout.group_size", "rollout.sampling.max_new_tokens",
        "rollout.engine.max_model_len", "rollout.engine.max_num_seqs", "rollout.engine.kv_cache_gib",
        "rollout.engine.threads", "train.steps", "train.optimizer.lr", "train.memory.micro_batch_size",
        "train.compute.threads",
    )
    if config.train.memory.logprob_chunk_tokens is not None and config.train.memory.logprob_chunk_tokens <= 0:
        raise ConfigError(f"train.memory.logprob_chunk_tokens must be > 0 (or none: sized to 128 MiB of logits), "
                          f"got {config.train.memory.logprob_chunk_tokens}")
    if config.rollout.group_size < 2:
        raise ConfigError("rollout.group_size must be >= 2: GRPO compares completions of the same prompt")
    if config.rollout.sampling.temperature <= 0:
        raise ConfigError("rollout.sampling.temperature must be > 0 for training rollouts (eval is always greedy)")
    if config.scoring.concurrency < 1:
        raise ConfigError(
            f"scoring.concurrency must be >= 1 (sync reward calls run at once per worker), "
            f"got {config.scoring.concurrency}"
        )
    if not 0 < config.rollout.sampling.top_p <= 1:
        raise ConfigError(f"rollout.sampling.top_p must be in (0, 1], got {config.rollout.sampling.top_p}")
    for name in ("clip_eps", "clip_eps_high") if config.train.loss.objective != "cispo" else ("clip_eps",):
        value = getattr(config.train.loss, name)
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"train.loss.{name} must be in (0, 1), got {value}")
    for dotted in ("train.lr_schedule.warmup_steps", "eval.every_steps", "eval.max_new_tokens",
                   "output.save_every_steps", "output.rollouts_per_step", "train.memory.heap_mmap_threshold_mib"):
        if (_dotted(config, dotted) or 0) < 0:
            raise ConfigError(f"{dotted} must be >= 0, got {_dotted(config, dotted)}")
    _validate_wandb(config)
    if config.rollout.sampling.max_new_tokens >= config.rollout.engine.max_model_len:
        raise ConfigError(
            f"rollout.sampling.max_new_tokens ({config.rollout.sampling.max_new_tokens}) must be < "
            "rollout.engine.max_model_len "
            f"({config.rollout.engine.max_model_len}) to leave room for the prompt"
        )
    if not 0 <= config.train.lr_schedule.min_lr_ratio <= 1:
        raise ConfigError("train.lr_schedule.min_lr_ratio must be in [0, 1], got "
                          f"{config.train.lr_schedule.min_lr_ratio}")
    if config.train.max_staleness < 0:
        raise ConfigError(f"train.max_staleness must be >= 0, got {config.train.max_staleness}")
    _positive(config, "train.ppo_epochs", "train.minibatches", "train.max_skipped_steps")
    if config.train.memory.activation_checkpointing_every < 1:
        raise ConfigError(
            f"train.memory.activation_checkpointing_every must be >= 1 (checkpoint every N-th decoder block), "
            f"got {config.train.memory.activation_checkpointing_every}"
        )
    if config.train.minibatches > config.rollout.prompts_per_step:
        raise ConfigError(
            f"train.minibatches ({config.train.minibatches}) must be <= rollout.prompts_per_step "
            f"({config.rollout.prompts_per_step}): each minibatch holds whole prompt groups"
        )
    if config.scoring.timeout_s is not None and config.scoring.timeout_s <= 0:
        raise ConfigError(f"scoring.timeout_s must be > 0 (or None for no limit), got {config.scoring.timeout_s}")
    if not math.isfinite(config.scoring.error_value):
        raise ConfigError(f"scoring.error_value must be a finite number, got {config.scoring.error_value}")
    if not 0 <= config.scoring.max_error_frac <= 1:
        raise ConfigError(f"scoring.max_error_frac must be in [0, 1], got {config.scoring.max_error_frac}")
    _validate_dtypes(config)
    _validate_kl(config)
    _validate_truncation(config)
    if not config.model.checkpoint:
        raise ConfigError("model.checkpoint is empty: set it to an HF checkpoint directory")
    from titanrl.models.hf_checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, checked_tensors, read_config
    from titanrl.models.qwen3.moe import Qwen3MoeConfig

    try:
        model_config = read_config(config.model.checkpoint)
    except CheckpointError as e:
        raise ConfigError(f"model.checkpoint: {e}") from e
    ckpt = Path(config.model.checkpoint)
    if not (ckpt / SINGLE_FILE).is_file() and not (ckpt / INDEX_FILE).is_file():
        raise ConfigError(f"model.checkpoint: {str(ckpt)!r} has no {SINGLE_FILE} or {INDEX_FILE}")
    try:
        checked_tensors(ckpt, model_config)  # tensor names and shapes against config.json, headers only
    except CheckpointError as e:
        raise ConfigError(f"model.checkpoint: {e}") from e
    if not (ckpt / "tokenizer.json").is_file() and not (ckpt / "tokenizer_config.json").is_file():
        raise ConfigError(f"model.checkpoint: {str(ckpt)!r} has no tokenizer files (tokenizer.json)")
    if config.rollout.engine.record_routed_experts and not isinstance(model_config, Qwen3MoeConfig):
        raise ConfigError(
            f"rollout.engine.record_routed_experts=True needs a mixture-of-experts checkpoint, but model.checkpoint is "
            f"{model_config.HF_ARCHITECTURE}: set rollout.engine.record_routed_experts=None (or False)"
        )
    _validate_data(config)
    if config.agent.fn is not None:
        _validate_agent(config)
    elif config.env.factory is not None:
        resolve_env_factory(config.env.factory)
        _positive(config, "env.max_turns", "env.max_total_tokens")
        if config.env.sandbox_pool_size < 0:
            raise ConfigError("env.sandbox_pool_size must be >= 0")
    elif not config.rewards:
        raise ConfigError(
            "rewards is empty: give at least one reward(prompt, completion, **row_fields) -> float (or an env, "
            "or an agent)"
        )
    for i, spec in enumerate(config.rewards):
        resolve_reward(spec, i)
    _validate_rewards(config)
    if config.rollout.elastic and not config.rollout.continuous:
        raise ConfigError("rollout.elastic grows and shrinks the workers mid-run in continuous mode: set "
                          "rollout.continuous=true (lock-step splits each step over a fixed number of workers)")
    if config.rollout.elastic and config.train.compute.threads_when_rollouts_idle is not None:
        raise ConfigError("rollout.elastic cannot be combined with train.compute.threads_when_rollouts_idle (its "
                          "flags cover rollout.num_workers workers): set one of them")
    if config.train.auto_resume and config.output.save_every_steps < 1:
        raise ConfigError("train.auto_resume resumes from the newest checkpoint after the trainer is lost: set "
                          "output.save_every_steps >= 1 (1 loses no step)")
    _validate_trainer_layout(config, model_config)
    check_lora(config.lora, config.train)
    lora_targets(config.lora, model_config)
    validate_xla(config, model_config)


SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
"""What `Dataset.save_to_disk` (and `DatasetDict.save_to_disk`) leave in the directory."""


def _validate_data(config: RunConfig) -> None:
    """Where the rows come from (a path that exists, or rows in memory); the rows themselves are
    checked when `titanrl.data` loads them, still before any actor starts."""
    import glob

    dc = config.data
    for split in ("train", "eval"):
        path, rows = getattr(dc, f"{split}_file"), getattr(dc, f"{split}_rows")
        if rows is not None:
            if path:
                raise ConfigError(f"data.{split}_file and data.{split}_rows are both set: keep one source")
            if not isinstance(rows, list) and type(rows).__module__.split(".")[0] != "datasets":
                raise ConfigError(f"data.{split}_rows must be a list of dicts or a datasets.Dataset, "
                                  f"got {type(rows).__name__}")
            continue
        if split == "train" and not path:
            raise ConfigError("data.train_file is empty: set it to a .jsonl, .json, .parquet or .csv file of "
                              "prompts or a saved dataset directory (or data.train_rows in Python)")
        if path and not (Path(path).exists() or (glob.has_magic(path) and glob.glob(path))):
            what = "pattern matches no file" if glob.has_magic(path) else "does not exist"
            raise ConfigError(f"data.{split}_file: {path!r} {what}")
        if path and Path(path).is_dir() and not any((Path(path) / f).is_file() for f in SAVED_DATASET_FILES):
            raise ConfigError(f"data.{split}_file: {path!r} is a directory but not one written by "
                              "datasets.Dataset.save_to_disk (no state.json): point at the data files "
                              "(a glob such as 'DIR/train-*.parquet' reads several)")
    if dc.system_prompt and not dc.messages_field:
        raise ConfigError("data.system_prompt is set but data.messages_field is empty: the system prompt goes "
                          "before each row's chat messages; set data.messages_field (a string field is one "
                          "user message)")
    if dc.messages_field and config.env.factory is not None:
        raise ConfigError("data.messages_field renders single-turn prompts, but env.factory is set (an environment "
                          "writes its own prompt in reset()): set data.messages_field='' and read the messages "
                          "in the environment")


def _validate_rewards(config: RunConfig) -> None:
    """reward_weights, scoring.health and the DAPO sample-side settings of `rollout`."""
    from titanrl.rewards.named import reward_names

    weights, rc, health = config.reward_weights, config.rollout, config.scoring.health
    if weights and len(weights) != len(config.rewards):
        raise ConfigError(f"reward_weights has {len(weights)} entries but rewards has {len(config.rewards)}: "
                          "give one weight per reward, in the order of `rewards` (or none: all 1)")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(f"reward_weights[{i}] must be a finite number, got {w!r}")
    names = reward_names([resolve_reward(spec, i) for i, spec in enumerate(config.rewards)])
    if rc.shaping.overlong_buffer > 0:
        names.append("overlong_penalty")
    for pair in health.agreement_pairs:
        parts = pair.split(":") if isinstance(pair, str) else []
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"scoring.health.agreement_pairs: {pair!r} is not 'reward_a:reward_b'")
        for name in parts:
            if name not in names:
                raise ConfigError(f"scoring.health.agreement_pairs: {pair!r} names {name!r}, which is not a reward "
                                  f"of this run (its rewards are named {names})")
    if health.hacking_window < 1:
        raise ConfigError(f"scoring.health.hacking_window must be >= 1 (evaluations back), got {health.hacking_window}")
    for name in ("hacking_reward_rise", "hacking_accuracy_rise"):
        if not math.isfinite(getattr(health, name)) or getattr(health, name) < 0:
            raise ConfigError(f"scoring.health.{name} must be a finite number >= 0, got {getattr(health, name)}")
    if rc.shaping.dynamic_sampling and rc.continuous:
        raise ConfigError("rollout.shaping.dynamic_sampling works with lock-step rollouts only (a continuous run's "
                          "groups "
                          "are tied to their step when admitted): set rollout.continuous=False or "
                          "rollout.shaping.dynamic_sampling=False")
    if rc.shaping.dynamic_sampling_max_requests < 1:
        raise ConfigError("rollout.shaping.dynamic_sampling_max_requests must be >= 1, got "
                          f"{rc.shaping.dynamic_sampling_max_requests}")
    if not 0 <= rc.shaping.overlong_buffer <= rc.sampling.max_new_tokens:
        raise ConfigError("rollout.shaping.overlong_buffer must be in [0, "
                          f"rollout.sampling.max_new_tokens={rc.sampling.max_new_tokens}], "
                          f"got {rc.shaping.overlong_buffer}")
    if rc.shaping.overlong_buffer > 0 and config.env.factory is not None:
        raise ConfigError("rollout.shaping.overlong_buffer (the soft overlong penalty) is for single-turn rollouts; "
                          "with "
                          "env.factory set, give the environment its own length penalty and set it to 0")
    if not math.isfinite(rc.shaping.overlong_penalty) or rc.shaping.overlong_penalty < 0:
        raise ConfigError("rollout.shaping.overlong_penalty must be a finite number >= 0, got "
                          f"{rc.shaping.overlong_penalty}")


def _validate_truncation(config: RunConfig) -> None:
    """rollout.sampling.top_k / top_p / logprobs: what the generator and the trainer can both score."""
    rc, p = config.rollout, config.train.parallel
    if rc.sampling.top_k < 0:
        raise ConfigError(f"rollout.sampling.top_k must be >= 0 (0: off), got {rc.sampling.top_k}")
    if rc.sampling.top_k == 0 and rc.sampling.top_p == 1:
        return
    if rc.sampling.logprobs == "raw" and rc.sampling.temperature != 1:
        raise ConfigError(
            f"rollout.sampling.logprobs='raw' with rollout.sampling.top_k={rc.sampling.top_k}, "
            f"top_p={rc.sampling.top_p} needs rollout.sampling.temperature=1, "
            f"got {rc.sampling.temperature}: vLLM's raw logprobs are log_softmax of the logits before temperature, "
            "so at "
            f"another temperature the generator's and the trainer's logprobs would differ. Set "
            "rollout.sampling.temperature=1, or rollout.sampling.logprobs='sampled' (both sides score the "
            "truncated distribution)"
        )
    if rc.sampling.logprobs == "sampled" and p.tp > 1:
        raise ConfigError(
            f"rollout.sampling.top_k={rc.sampling.top_k} / top_p={rc.sampling.top_p} with "
            "rollout.sampling.logprobs='sampled' cannot run with "
            f"train.parallel.tp={p.tp}: the tensor-parallel LM head holds vocabulary shards, and the "
            f"top-k / top-p kept set needs a sort over the whole vocabulary, which is not implemented across "
            f"shards. Set train.parallel.tp=1, rollout.sampling.top_k=0 and top_p=1, or rollout.sampling.logprobs='raw'"
        )
    import torch

    if rc.sampling.logprobs == "sampled" and config.batch_invariant and torch.version.cuda is not None:
        # vLLM's CPU build keeps tokens by a per-row sort the trainer repeats op for op (bitwise);
        # its CUDA build uses Triton (pivot-based) or FlashInfer top-k / top-p kernels instead.
        raise ConfigError(
            f"batch_invariant=True with rollout.sampling.top_k={rc.sampling.top_k} / top_p={rc.sampling.top_p} and "
            "rollout.sampling.logprobs='sampled' "
            f"is bitwise only with vLLM's CPU build: vLLM on CUDA decides the kept tokens with its own Triton / "
            f"FlashInfer kernels, which the trainer does not reproduce bit for bit. Set rollout.sampling.top_k=0 and "
            f"top_p=1, rollout.sampling.logprobs='raw' (with rollout.sampling.temperature=1), or batch_invariant=False"
        )


def _validate_dtypes(config: RunConfig) -> None:
    """Storage (model.dtype) vs compute (train.compute.dtype) dtypes, and what batch invariance needs."""
    storage, compute = config.model.dtype, config.generator_dtype
    if storage == "bfloat16" and compute == "float32":
        # Upcasting bf16 weights buys no precision (gradients and the update are rounded to bf16
        # again) and costs float32 compute: refused rather than given a meaning.
        raise ConfigError(
            "train.compute.dtype='float32' is wider than model.dtype='bfloat16' (the weights' storage): set "
            "model.dtype='float32' for float32 training, or train.compute.dtype=None (or 'bfloat16') to compute "
            "in bfloat16; mixed precision is model.dtype='float32' with train.compute.dtype='bfloat16'"
        )
    if config.batch_invariant and compute != "float32":
        # The generator's batch-invariant attention reads vLLM's KV cache in float32 only.
        field = "train.compute.dtype" if config.train.compute.dtype is not None else "model.dtype"
        raise ConfigError(
            f"batch_invariant=True needs float32 compute, but {field}={compute!r}: the batch-invariant "
            "attention inside vLLM reads a float32 KV cache. Set train.compute.dtype=None and model.dtype="
            "'float32', or batch_invariant=False"
        )


def _validate_kl(config: RunConfig) -> None:
    """The KL penalty towards the reference policy (train.kl.coef, kl_estimator, kl_in_reward)."""
    t, p = config.train, config.train.parallel
    if not (math.isfinite(t.kl.coef) and t.kl.coef >= 0):
        raise ConfigError(f"train.kl.coef must be a finite number >= 0 (0: no KL penalty, no reference policy "
                          f"held), got {t.kl.coef}")
    if t.kl.coef > 0 and p.pp > 1:
        raise ConfigError(
            f"train.kl.coef > 0 is not implemented for the pipelined trainer (train.parallel.pp={p.pp}): its "
            f"logprobs exist only inside the last stage's loss. Set train.parallel.pp=1 or train.kl.coef=0"
        )


def _validate_trainer_layout(config: RunConfig, model_config: Any) -> None:
    """The trainer's device and parallel layout against the model (the layout sets the world size)."""
    from titanrl.config.parallel import check_compile, check_idle_threads, uses_onednn_linears, validate_parallel
    from titanrl.config.schema import compute_dtype

    p = config.train.parallel
    validate_parallel(p, model_config, world_size=None, batch_invariant=config.batch_invariant)
    check_compile(config.train, config.batch_invariant)
    check_idle_threads(config.train, config.batch_invariant)
    if config.train.compute.cpu_matmul == "onednn" and config.train.compute.device in ("cpu", "auto"):
        uses_onednn_linears(config.train, config.batch_invariant, "cpu", compute_dtype(config.model, config.train))
    if config.train.compute.threads_when_rollouts_idle is not None and config.ray_address is not None:
        raise ConfigError("train.compute.threads_when_rollouts_idle needs the rollout workers on the trainer's machine "
                          f"(their busy flags are a /dev/shm file), but ray_address={config.ray_address!r} joins "
                          "a cluster: unset one of them")
    if config.train.off_policy.decoupled_loss and p.world_size > 1:
        raise ConfigError(
            f"train.off_policy.decoupled_loss is implemented for the single-process trainer, but train.parallel has "
            f"world size {p.world_size}: set train.off_policy.decoupled_loss=false or use one trainer process"
        )
    if config.train.off_policy.behaviour_weight_cap <= 0:
        raise ConfigError(
            f"train.off_policy.behaviour_weight_cap must be > 0, got {config.train.off_policy.behaviour_weight_cap}"
        )
    _validate_moe(config, model_config)
    _validate_loss(config)


def _validate_loss(config: RunConfig) -> None:
    """train.loss.objective, its aggregation, entropy bonus and off-policy correction against each other
    and the layout (titanrl/trainer/losses)."""
    t, p = config.train, config.train.parallel
    if t.loss.objective == "dr_grpo":
        if t.loss.scale_advantages_by_std:
            raise ConfigError("train.loss.objective='dr_grpo' never divides advantages by the group std: set "
                              "train.loss.scale_advantages_by_std=None (or false), or train.loss.objective='grpo'")
        if t.loss.aggregation not in (None, "seq-mean-token-sum-norm"):
            raise ConfigError(f"train.loss.objective='dr_grpo' is defined by its constant normaliser "
                              f"(seq-mean-token-sum-norm), but train.loss.aggregation={t.loss.aggregation!r}: "
                              f"set train.loss.aggregation=None, or train.loss.objective='grpo' with that aggregation")
    if t.loss.objective == "gspo" and t.loss.clip_eps_high is not None:
        raise ConfigError(
            "train.loss.clip_eps_high does not apply to train.loss.objective='gspo' (a sequence ratio): set "
            "train.loss.gspo_clip_eps=(below, above) instead and train.loss.clip_eps_high=None"
        )
    high = t.loss.clip_eps_high
    if t.loss.objective == "cispo" and high is not None and not (math.isfinite(high) and high > 0):
        raise ConfigError(f"train.loss.clip_eps_high (CISPO's weight truncation 1 + clip_eps_high) must be a finite "
                          f"number > 0, got {t.loss.clip_eps_high}")
    if not all(0 < e < 1 for e in t.loss.gspo_clip_eps):
        raise ConfigError(f"train.loss.gspo_clip_eps must be two numbers in (0, 1), got {t.loss.gspo_clip_eps}")
    if not math.isfinite(t.loss.entropy_coef):
        raise ConfigError(f"train.loss.entropy_coef must be a finite number, got {t.loss.entropy_coef}")
    if t.loss.length_norm is not None and t.loss.length_norm <= 0:
        raise ConfigError(f"train.loss.length_norm must be > 0 (or None: rollout.sampling.max_new_tokens), "
                          f"got {t.loss.length_norm}")
    if not (math.isfinite(t.off_policy.cap) and t.off_policy.cap > 0):
        raise ConfigError(f"train.off_policy.cap must be a finite number > 0, got {t.off_policy.cap}")
    if t.off_policy.low is not None and not 0 <= t.off_policy.low < t.off_policy.cap:
        raise ConfigError(f"train.off_policy.low must be in [0, train.off_policy.cap={t.off_policy.cap}), "
                          f"got {t.off_policy.low}")
    corrected = t.off_policy.correction != "none"
    if corrected and t.off_policy.decoupled_loss:
        raise ConfigError(
            f"train.off_policy.correction={t.off_policy.correction!r} with train.off_policy.decoupled_loss=true: "
            f"both take the ratio around the trainer's weights and weigh pi_trainer / pi_generator "
            f"(decoupled_loss is 'tis_token' at behaviour_weight_cap); set train.off_policy.decoupled_loss=false"
        )
    several_updates = t.minibatches > 1 or t.ppo_epochs > 1
    if corrected and p.world_size > 1 and several_updates:
        raise ConfigError(
            f"train.off_policy.correction={t.off_policy.correction!r} with train.minibatches={t.minibatches} / "
            f"ppo_epochs={t.ppo_epochs} needs the batch-start logprobs before the first update, which only the "
            f"single-process trainer computes; train.parallel has world size {p.world_size}: set "
            f"train.minibatches=1 and train.ppo_epochs=1, or use one trainer process")
    sequence_level = t.loss.objective == "gspo" or t.off_policy.correction in ("tis_sequence", "mis_sequence", "mis_geometric")
    if sequence_level and p.pp > 1 and p.cp > 1:
        field = (
            "train.loss.objective='gspo'"
            if t.loss.objective == "gspo"
            else f"train.off_policy.correction={t.off_policy.correction!r}"
        )
        raise ConfigError(f"{field} sums over whole sequences, which is not implemented with train.parallel pp={p.pp} "
                          f"and cp={p.cp} together: set pp=1 or cp=1")


def _validate_moe(config: RunConfig, model_config: Any) -> None:
    """Router replay and load balancing against the model (dense or MoE) and the layout."""
    t, p = config.train, config.train.parallel
    if t.moe.load_balance not in ("aux_loss", "bias", "none"):
        raise ConfigError(f"train.moe.load_balance must be 'aux_loss', 'bias' or 'none', got {t.moe.load_balance!r}")
    if t.moe.aux_loss_coef is not None and not (math.isfinite(t.moe.aux_loss_coef) and t.moe.aux_loss_coef >= 0):
        raise ConfigError(f"train.moe.aux_loss_coef must be a finite number >= 0 (or None: the model's "
                          f"router_aux_loss_coef), got {t.moe.aux_loss_coef}")
    if not (math.isfinite(t.moe.bias_update_rate) and t.moe.bias_update_rate > 0):
        raise ConfigError(f"train.moe.bias_update_rate must be a finite number > 0, got {t.moe.bias_update_rate}")
    moe = getattr(model_config, "num_experts", None) is not None
    if t.moe.router_replay and not moe:
        raise ConfigError(
            f"train.moe.router_replay=true needs a mixture-of-experts policy, but model.checkpoint holds a dense "
            f"{type(model_config).__name__} (no routers to replay): set train.moe.router_replay=false"
        )
    if not moe:
        return
    if t.moe.router_replay and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            f"train.moe.router_replay=true runs in one process or under dp_replicate / dp_shard / cp only, but "
            f"train.parallel has tp={p.tp}, pp={p.pp}: pipeline micro-batches and tensor-parallel layouts "
            f"hand the routers tokens the replayed experts are not laid out for. Set them to 1 or "
            f"train.moe.router_replay=false"
        )
    if (p.pp > 1 or (p.tp > 1 and p.sequence_parallel)) and t.moe.load_balance != "none":
        raise ConfigError(
            f"train.moe.load_balance={t.moe.load_balance!r} is not implemented for pipelined or sequence-parallel "
            f"trainers (train.parallel.pp={p.pp}, tp={p.tp}, sequence_parallel={p.sequence_parallel}): set "
            f"train.moe.load_balance='none', or train.parallel.pp=1 and sequence_parallel=false"
        )


def _validate_wandb(config: RunConfig) -> None:
    """The wandb package, when W&B logging is on (a run must not find out at its first step)."""
    out = config.output
    if not out.wandb_project or out.wandb_mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"output.wandb_project={out.wandb_project!r} needs the wandb package, which cannot be imported ({e}): "
            "pip install 'titanrl[wandb]', or set output.wandb_project='' (or output.wandb_mode='disabled')"
        ) from e


LORA_DEFAULTS = LoraConfig()
LORA_UNSUPPORTED_DEGREES = ("pp", "cp", "ep")
"""train.parallel degrees LoRA refuses above 1 (pipeline, context and expert parallel are not built for
adapters yet); dp_shard, dp_replicate and tp shard the adapters with their linears."""


def check_lora(lora: LoraConfig, train: TrainConfig, device_type: str | None = None) -> None:
    """lora.* on its own and against the trainer's layout (the model is `lora_targets`' part):
    settings given while LoRA is off, values the merged path cannot honour, layouts not built yet.
    device_type: the trainer's resolved device (None: train.compute.device)."""
    if lora.rank < 0:
        raise ConfigError(f"lora.rank must be >= 0 (0 turns LoRA off), got {lora.rank}")
    if lora.rank == 0:
        changed = [f"lora.{name}={getattr(lora, name)!r}" for name in ("sync", "alpha", "dropout", "target_modules")
                   if getattr(lora, name) != getattr(LORA_DEFAULTS, name)]
        if changed:
            raise ConfigError(f"{', '.join(changed)} set while lora.rank=0 (LoRA off): set lora.rank > 0 "
                              f"(e.g. --lora.rank=8) or leave {changed[0].partition('=')[0]} at its default")
        return
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ConfigError(f"lora.alpha must be a finite number > 0 (the adapters' scale is alpha / rank), got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if lora.dropout > 0:
        raise ConfigError(f"lora.dropout={lora.dropout} is not built: the generators run without dropout, so the "
                          f"trainer's log-probabilities would no longer equal theirs: set lora.dropout=0")
    device = device_type or train.compute.device
    if device == "xla":
        raise ConfigError("lora with train.compute.device='xla' is not supported yet: set train.compute.device to "
                          "'cpu', 'cuda' or 'auto', or lora.rank=0")
    p = train.parallel
    # FSDP2 / HSDP (dp_shard, dp_replicate) and tensor parallel (tp) shard the adapters with their
    # linears; the others are not built for adapters yet.
    degrees = [f"train.parallel.{name}={getattr(p, name)}" for name in LORA_UNSUPPORTED_DEGREES if getattr(p, name) > 1]
    if degrees:
        raise ConfigError(f"lora with {', '.join(degrees)} is not supported yet: LoRA trains in one process or "
                          f"under train.parallel.dp_shard / dp_replicate (FSDP2, HSDP) and tp (set "
                          f"{' and '.join(d.partition('=')[0] + '=1' for d in degrees)}, or lora.rank=0)")


def lora_targets(lora: LoraConfig, model_config: Any) -> tuple[str, ...]:
    """The leaf names of the linears LoRA wraps in `model_config`'s family (lora.target_modules, or
    the family spec's `lora_targets`); () when LoRA is off. Refuses MoE families and unknown names."""
    if lora.rank == 0:
        return ()
    from titanrl.models.architectures import spec_for

    spec = spec_for(model_config)
    if spec.is_moe:
        raise ConfigError(f"lora on a mixture-of-experts family ({spec.name}, model.checkpoint) is not supported "
                          f"yet (adapters on experts are not built): use a dense checkpoint or lora.rank=0")
    if lora.target_modules is None:
        return spec.lora_targets
    if not lora.target_modules:
        raise ConfigError(f"lora.target_modules is empty: name some of {', '.join(spec.lora_targets)} "
                          f"(or none for all of them)")
    unknown = [t for t in lora.target_modules if t not in spec.lora_targets]
    if unknown:
        raise ConfigError(f"lora.target_modules names {', '.join(map(repr, unknown))}, which the {spec.name} family "
                          f"does not have: the valid ones are {', '.join(spec.lora_targets)}")
    return tuple(t for t in spec.lora_targets if t in lora.target_modules)  # the spec's order: one spelling
