"""Typed run configuration, validated before any actor starts.

Every field has a docstring saying why it exists. `apply_overrides` takes CLI-style
`section.key=value` strings; `validate` checks types, paths and callables and raises
`ConfigError` naming the field and what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and the fix."""


@dataclass
class ModelConfig:
    """Which policy to start from."""

    checkpoint: str = ""
    """HF checkpoint directory (config.json, safetensors, tokenizer) of the initial policy."""
    dtype: str = "float32"
    """Parameter dtype for trainer and generator: float32 or bfloat16 (float32 is faster on AVX2 CPUs)."""


@dataclass
class DataConfig:
    """Prompts to train and evaluate on."""

    train_file: str = ""
    """JSON-lines file of training rows; each row has `prompt_field` plus any fields the reward needs."""
    eval_file: str = ""
    """JSON-lines file of held-out rows for eval accuracy; empty disables eval."""
    prompt_field: str = "prompt"
    """Row key holding the prompt text."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of the training rows."""
    on_overlong: str = "drop"
    """Rows whose prompt tokens + rollout.max_new_tokens exceed rollout.max_model_len: 'drop' them
    (one warning with the count and first index) or 'error' before any actor starts."""


@dataclass
class RolloutConfig:
    """How completions are generated."""

    num_workers: int = 1
    """Rollout worker actors, each owning one vLLM engine."""
    prompts_per_step: int = 32
    """Prompts per optimizer step; each yields `group_size` completions."""
    group_size: int = 8
    """Completions per prompt; GRPO compares them to each other."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens under the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 keeps the exact softmax the trainer recomputes."""
    max_new_tokens: int = 32
    """Token limit per completion."""
    max_model_len: int = 512
    """Longest prompt + completion the engine accepts."""
    max_num_seqs: int = 256
    """Sequences the engine batches at once; should cover prompts_per_step * group_size."""
    kv_cache_gib: float = 1.0
    """KV-cache memory per engine on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_multiprocess: bool = False
    """Run vLLM's engine core in its own process (slower start on CPU, isolates crashes)."""
    threads_per_worker: int = 1
    """Intra-op threads of each worker; 1 is robust on a busy 2-core machine."""
    reward_concurrency: int = 16
    """How many sync reward calls run at once per worker (its helper threads); async rewards of
    all samples are awaited together regardless. 1 (with reward_timeout_s=None) calls sync
    rewards one after another in the worker's own thread."""
    continuous: bool = False
    """Workers generate group by group, without waiting for the trainer, into a trajectory buffer
    (`titanrl.driver.sources.buffer`) that admits a group only while it can be trained within train.max_staleness
    versions, and take new weights between engine steps (partial rollouts; Sample.token_versions).
    Off: each step's prompts go to the workers as one fixed batch per worker, which makes a run
    reproducible to the bit even without batch_invariant."""
    on_weight_update: str = "continue"
    """Continuous mode, when new weights arrive while requests are running: 'continue' keeps their
    tokens and recomputes their KV cache with the new weights (each token keeps the version that
    sampled it); 'regenerate' aborts unfinished groups and generates them again from scratch."""
    weight_transport: str = "object_store"
    """How new weights reach the workers: 'object_store' (Ray's object store), 'shared_memory'
    (one shared-memory copy read by every worker of the machine) or 'broadcast' (a
    torch.distributed group from the trainer to the workers: gloo on CPU, NCCL on GPU)."""


@dataclass
class ParallelConfig:
    """How the trainer's processes split the work; the product of all degrees is its world size."""

    dp_replicate: int = 1
    """Data-parallel replicas holding full copies (HSDP's outer dimension when dp_shard > 1)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP columns split across ranks."""
    sequence_parallel: bool = False
    """With tp > 1, also shard norms and activations along the sequence between TP regions."""
    pp: int = 1
    """Pipeline stages: the decoder layers split into consecutive stages."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: 'GPipe', '1F1B' or 'Interleaved1F1B' (two stages per rank)."""
    cp: int = 1
    """Context-parallel degree: each sequence split across ranks, attention as a ring."""
    ep: int = 1
    """Expert-parallel degree for mixture-of-experts layers (reserved for the MoE model)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp * self.ep


@dataclass
class TrainConfig:
    """The GRPO optimization."""

    steps: int = 100
    """Optimizer steps (one per rollout batch)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    lr_decay: str = "constant"
    """After warm-up: 'constant', or 'cosine' down to min_lr_ratio * lr at the last step."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of lr under cosine decay."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping."""
    clip_eps: float = 0.2
    """PPO clip range below 1 (and above, unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None means clip_eps."""
    decoupled_loss: bool = False
    """Clip the PPO ratio around the trainer's weights before the update (the proximal policy) and
    weight each token by pi_prox / pi_generator (truncated at behaviour_weight_cap), as AReaL does
    for stale samples. On-policy it equals plain PPO-clip; with max_staleness >= 1 it keeps stale
    tokens from being clipped away. The trust region then acts only from a step's second
    minibatch or epoch on: with minibatches=ppo_epochs=1 a step is as unbounded as on-policy
    GRPO, so use an lr that is stable on-policy (or minibatches > 1). Costs one no-grad forward
    with minibatches or ppo_epochs > 1."""
    behaviour_weight_cap: float = 2.0
    """Truncation of the decoupled loss's importance weight pi_prox / pi_generator."""
    scale_advantages_by_std: bool = True
    """Divide group-centered rewards by the group std (GRPO); False gives Dr.GRPO-style centering."""
    micro_batch_size: int = 64
    """Sequences per forward/backward; gradients accumulate to one step per batch."""
    max_staleness: int = 0
    """Oldest policy version the trainer accepts, in steps behind; 0 is synchronous on-policy."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (PPO-style); >1 lets the clip bound on-policy updates."""
    minibatches: int = 1
    """Optimizer steps per pass: the batch's groups are split into this many minibatches."""
    max_skipped_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient norm (each skipped) that stop the run."""
    threads: int = 1
    """Intra-op threads of the trainer process."""
    device: str = "auto"
    """Trainer device: 'auto' (CUDA when present, else CPU), 'cpu' or 'cuda'."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer's processes (FSDP2, HSDP, TP/SP, PP, CP, EP)."""


@dataclass
class EvalConfig:
    """Held-out greedy accuracy."""

    every_steps: int = 10
    """Evaluate before step 1, every this many steps, and after the last; 0 disables."""
    max_prompts: int = 200
    """Evaluate on at most this many rows of the eval file."""
    max_new_tokens: int = 0
    """Token limit for eval completions; 0 means rollout.max_new_tokens."""
    correct_threshold: float = 1.0
    """A greedy completion counts as correct when its summed reward is at least this."""


@dataclass
class OutputConfig:
    """What lands in the run directory."""

    dir: str = ""
    """Run directory for metrics, TensorBoard events, plots, rollouts, checkpoints; empty: runs/<timestamp>.
    It must not already hold a run (nothing written before is ever overwritten)."""
    save_every_steps: int = 0
    """Write a full training checkpoint (for exact `--resume`) every this many steps; 0: only the
    final HF policy and the checkpoint written when a run stops early."""
    rollouts_per_step: int = 4
    """Sample groups per step written to rollouts.jsonl."""
    progress_bar: bool = True
    """Show a tqdm progress bar on stderr."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""


@dataclass
class EnvConfig:
    """Multi-turn environments: set `factory` to turn rollouts into episodes."""

    factory: Any = None
    """Environment factory `make_env(context) -> titanrl.envs.Environment` (or 'module:function');
    None means single-turn completions scored by `rewards`. With an env, `rewards` are optional
    and add to the episode's own reward."""
    max_turns: int = 4
    """Model turns per episode before it is cut off."""
    max_total_tokens: int = 512
    """Completion-side tokens per episode (model turns + inserted observations)."""
    sandbox_pool_size: int = 4
    """Pre-warmed code sandboxes per rollout worker (0: environments get no sandbox pool)."""


RewardFn = Callable[..., float]


@dataclass
class RunConfig:
    """A whole GRPO run: `titanrl.train(RunConfig(...))`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Initial policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Train and eval prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation settings."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer and loss settings."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Run directory contents."""
    rewards: list[Any] = field(default_factory=list)
    """Reward callables `(prompt, completion, **row_fields) -> float` (or 'module:function' strings); summed."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn environment, episode budgets and sandbox pool size."""
    seed: int = 0
    """Seed of sampling and of anything random in the trainer."""
    batch_invariant: bool = False
    """Trainer and generators compute every op with `titanrl.kernels`, so the generator's logprobs
    equal the trainer's bit for bit (parity/logprob_diff_max is 0) and runs are bitwise reproducible;
    False uses the faster library kernels."""
    reward_timeout_s: float | None = 60.0
    """A reward call (one sample) running longer than this gets `reward_error_value`; None: no limit."""
    reward_error_value: float = 0.0
    """Reward given to a sample whose reward function raised, timed out or returned a non-finite number."""
    ray_address: str | None = None
    """Address of an existing Ray cluster to join (e.g. '10.0.0.1:6379' or 'auto'); None starts a
    local single-machine Ray on loopback."""
    max_reward_error_frac: float = 0.5
    """A step where more than this fraction of samples had reward errors stops the run (after a checkpoint)."""


# ----------------------------------------------------------------------------- overrides


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Applies `section.key=value` strings (leading dashes allowed) to a copy of `config`.

    A value is parsed by its field's annotation: int, float, str; bool as true/false, yes/no,
    on/off or 1/0; `X | None` and `Any` fields take none/null for None; tuples and lists take
    comma-separated items (`train.betas=0.9,0.95`, `rewards=pkg.mod:fn,pkg.mod:fn2`); an `Any`
    field otherwise keeps the text (a 'module:function' string that `validate` imports).
    """
    config = _copy_sections(config)
    for raw in overrides:
        item = raw.lstrip("-")
        if "=" not in item:
            raise ConfigError(f"override {raw!r} must look like --section.key=value")
        dotted, text = item.split("=", 1)
        parent, leaf, hint = _resolve(config, dotted)
        setattr(parent, leaf, _parse_value(text, hint, dotted))
    return config


def _copy_sections(obj: Any) -> Any:
    """A copy of a config whose sections (nested ones too) are copies: overrides never touch the input."""
    obj = dataclasses.replace(obj)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            setattr(obj, f.name, _copy_sections(value))
    return obj


def _resolve(config: Any, dotted: str) -> tuple[Any, str, Any]:
    """The object holding `dotted`'s field, the field's name and its type annotation."""
    obj: Any = config
    parts = dotted.split(".")
    for depth, name in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        if name not in names:
            where = ".".join(parts[:depth]) or "the config"
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {'.'.join(parts[:depth] + close)!r}?" if close else ""
            raise ConfigError(f"unknown config key {dotted!r}: {where} has no field {name!r}{hint}")
        value = getattr(obj, name)
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(value):
                first = dataclasses.fields(value)[0].name
                raise ConfigError(
                    f"{dotted!r} is a section, not a value: set its fields one by one, e.g. --{dotted}.{first}=..."
                )
            return obj, name, typing.get_type_hints(type(obj))[name]
        obj = value
        if not dataclasses.is_dataclass(obj):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(parts[: depth + 1])} is not a section")
    raise AssertionError("unreachable")


_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class _Unparsable(ValueError):
    """A command-line value does not fit its field's type."""


def _parse_value(text: str, hint: Any, dotted: str) -> Any:
    """Parses `text` as a value of `hint`; a ConfigError names the key and the expected type."""
    try:
        return _parse(text.strip(), hint)
    except _Unparsable:
        raise ConfigError(f"{dotted}={text!r} is not a valid {_expected(hint)}") from None


def _parse(text: str, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None if text.lower() in _NONE_WORDS else text
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.lower() in _NONE_WORDS:
            return None
        for option in args:
            if option is not type(None):
                try:
                    return _parse(text, option)
                except _Unparsable:
                    pass
        raise _Unparsable(text)
    if hint is bool:
        if text.lower() in _TRUE_WORDS:
            return True
        if text.lower() in _FALSE_WORDS:
            return False
        raise _Unparsable(text)
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise _Unparsable(text) from None
    if hint is str:
        return text
    if origin in (tuple, list):
        items = _split_items(text)
        if origin is list:
            item_hint = args[0] if args else Any
            # An item 'none' stays a string: a list has no use for None entries.
            return [item if item_hint is Any else _parse(item, item_hint) for item in items]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse(item, args[0]) for item in items)
        if len(items) != len(args):
            raise _Unparsable(text)
        return tuple(_parse(item, a) for item, a in zip(items, args, strict=True))
    raise _Unparsable(text)


def _split_items(text: str) -> list[str]:
    """'a,b', '(a, b)' and '[a,b]' all give ['a', 'b']; '' and '[]' give []."""
    if text[:1] + text[-1:] in ("()", "[]"):
        text = text[1:-1]
    return [item.strip() for item in text.split(",") if item.strip()]


def _expected(hint: Any) -> str:
    """What a command-line value of `hint` looks like, for error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return "value ('package.module:function', or none)"
    if origin in (typing.Union, types.UnionType):
        options = [_expected(a) for a in args if a is not type(None)]
        return " or ".join(options + (["none"] if type(None) in args else []))
    if hint is bool:
        return "bool (true/false, yes/no, on/off, 1/0)"
    if hint is int:
        return "int (like 8)"
    if hint is float:
        return "float (like 0.5 or 3e-4)"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"comma-separated list of {_type_name(args[0])}"
        example = ",".join("0.9" if a is float else "1" if a is int else "x" for a in args)
        return f"tuple of {len(args)} comma-separated values ({', '.join(map(_type_name, args))}; like {example})"
    if origin is list:
        return "comma-separated list"
    return f"{_type_name(hint)} (it cannot be set from the command line; set it in the config file)"


# ----------------------------------------------------------------------------- validation


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _check_type(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(_check_type, value, args))
    if origin is list:
        return isinstance(value, list)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _check_types(obj: Any, prefix: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_types(value, f"{name}.")
        elif not _check_type(value, hints[f.name]):
            raise ConfigError(
                f"{name} must be {_type_name(hints[f.name])}, got {type(value).__name__} {value!r}"
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


def _positive(config: RunConfig, *dotted: str) -> None:
    for d in dotted:
        section, name = d.split(".")
        value = getattr(getattr(config, section), name)
        if value <= 0:
            raise ConfigError(f"{d} must be > 0, got {value}")


def validate(config: RunConfig) -> None:
    """Raises ConfigError for anything that would fail later, before any actor starts."""
    if not isinstance(config, RunConfig):
        raise ConfigError(f"expected a titanrl.RunConfig, got {type(config).__name__}")
    _check_types(config, "")
    _positive(
        config,
        "rollout.num_workers", "rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
        "rollout.max_model_len", "rollout.max_num_seqs", "rollout.kv_cache_gib", "rollout.threads_per_worker",
        "train.steps", "train.lr", "train.micro_batch_size", "train.threads",
    )
    if config.rollout.group_size < 2:
        raise ConfigError("rollout.group_size must be >= 2: GRPO compares completions of the same prompt")
    if config.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 for training rollouts (eval is always greedy)")
    if config.rollout.reward_concurrency < 1:
        raise ConfigError(
            f"rollout.reward_concurrency must be >= 1 (sync reward calls run at once per worker), "
            f"got {config.rollout.reward_concurrency}"
        )
    for key, allowed in (("on_weight_update", ("continue", "regenerate")),
                         ("weight_transport", ("object_store", "shared_memory", "broadcast"))):
        if getattr(config.rollout, key) not in allowed:
            raise ConfigError(f"rollout.{key} must be one of {', '.join(map(repr, allowed))}, "
                              f"got {getattr(config.rollout, key)!r}")
    if not 0 < config.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {config.rollout.top_p}")
    for name in ("clip_eps", "clip_eps_high"):
        value = getattr(config.train, name)
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"train.{name} must be in (0, 1), got {value}")
    for dotted in ("train.warmup_steps", "eval.every_steps", "eval.max_new_tokens", "output.save_every_steps",
                   "output.rollouts_per_step"):
        section, name = dotted.split(".")
        if getattr(getattr(config, section), name) < 0:
            raise ConfigError(f"{dotted} must be >= 0, got {getattr(getattr(config, section), name)}")
    if config.rollout.max_new_tokens >= config.rollout.max_model_len:
        raise ConfigError(
            f"rollout.max_new_tokens ({config.rollout.max_new_tokens}) must be < rollout.max_model_len "
            f"({config.rollout.max_model_len}) to leave room for the prompt"
        )
    if config.train.lr_decay not in ("constant", "cosine"):
        raise ConfigError(f"train.lr_decay must be 'constant' or 'cosine', got {config.train.lr_decay!r}")
    if not 0 <= config.train.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {config.train.min_lr_ratio}")
    if config.train.max_staleness < 0:
        raise ConfigError(f"train.max_staleness must be >= 0, got {config.train.max_staleness}")
    _positive(config, "train.ppo_epochs", "train.minibatches", "train.max_skipped_steps")
    if config.train.minibatches > config.rollout.prompts_per_step:
        raise ConfigError(
            f"train.minibatches ({config.train.minibatches}) must be <= rollout.prompts_per_step "
            f"({config.rollout.prompts_per_step}): each minibatch holds whole prompt groups"
        )
    if config.data.on_overlong not in ("drop", "error"):
        raise ConfigError(f"data.on_overlong must be 'drop' or 'error', got {config.data.on_overlong!r}")
    if config.reward_timeout_s is not None and config.reward_timeout_s <= 0:
        raise ConfigError(f"reward_timeout_s must be > 0 (or None for no limit), got {config.reward_timeout_s}")
    if not math.isfinite(config.reward_error_value):
        raise ConfigError(f"reward_error_value must be a finite number, got {config.reward_error_value}")
    if not 0 <= config.max_reward_error_frac <= 1:
        raise ConfigError(f"max_reward_error_frac must be in [0, 1], got {config.max_reward_error_frac}")
    if config.model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {config.model.dtype!r}")
    if not config.model.checkpoint:
        raise ConfigError("model.checkpoint is empty: set it to an HF checkpoint directory")
    from titanrl.models.hf_checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, read_config

    try:
        model_config = read_config(config.model.checkpoint)
    except CheckpointError as e:
        raise ConfigError(f"model.checkpoint: {e}") from e
    ckpt = Path(config.model.checkpoint)
    if not (ckpt / SINGLE_FILE).is_file() and not (ckpt / INDEX_FILE).is_file():
        raise ConfigError(f"model.checkpoint: {str(ckpt)!r} has no {SINGLE_FILE} or {INDEX_FILE}")
    if not (ckpt / "tokenizer.json").is_file() and not (ckpt / "tokenizer_config.json").is_file():
        raise ConfigError(f"model.checkpoint: {str(ckpt)!r} has no tokenizer files (tokenizer.json)")
    for name in ("train_file", "eval_file"):
        path = getattr(config.data, name)
        if name == "train_file" and not path:
            raise ConfigError("data.train_file is empty: set it to a JSON-lines file of prompts")
        if path and not Path(path).is_file():
            raise ConfigError(f"data.{name}: file {path!r} does not exist")
    if config.env.factory is not None:
        resolve_env_factory(config.env.factory)
        _positive(config, "env.max_turns", "env.max_total_tokens")
        if config.env.sandbox_pool_size < 0:
            raise ConfigError("env.sandbox_pool_size must be >= 0")
    elif not config.rewards:
        raise ConfigError(
            "rewards is empty: give at least one reward(prompt, completion, **row_fields) -> float (or an env)"
        )
    for i, spec in enumerate(config.rewards):
        resolve_reward(spec, i)
    _validate_trainer_layout(config, model_config)


def _validate_trainer_layout(config: RunConfig, model_config: Any) -> None:
    """The trainer's device and parallel layout against the model (the layout sets the world size)."""
    from titanrl.trainer.parallel.validate import validate_parallel

    if config.train.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"train.device must be 'auto', 'cpu' or 'cuda', got {config.train.device!r}")
    p = config.train.parallel
    validate_parallel(p, model_config, world_size=None, batch_invariant=config.batch_invariant)
    if config.train.decoupled_loss and p.world_size > 1:
        raise ConfigError(
            f"train.decoupled_loss is implemented for the single-process trainer, but train.parallel has "
            f"world size {p.world_size}: set train.decoupled_loss=false or use one trainer process"
        )
    if config.train.behaviour_weight_cap <= 0:
        raise ConfigError(f"train.behaviour_weight_cap must be > 0, got {config.train.behaviour_weight_cap}")
