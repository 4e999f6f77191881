"""Config validation: every bad config fails in `validate`/`apply_overrides` with a message
naming the field and the fix, before any Ray actor starts; the CLI turns those into exit code 2."""

from __future__ import annotations

import dataclasses
import functools
import json
import textwrap

import pytest

from titanrl.config import (
    ConfigError,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    resolve_reward,
    validate,
)
from titanrl.models.tiny import tiny_config

from support.config_cases import checkpoint_dir, fails_validation, good_config, length_reward  # noqa: F401  (fixtures)


# ----------------------------------------------------------------------------- positive cases


def test_good_config_validates(good_config):
    """A complete config (checkpoint, existing train file, callable reward) passes validate."""
    assert validate(good_config) is None  # no ConfigError


def test_module_function_reward_string_validates(good_config):
    """A 'module:function' reward string resolves to the function it names."""
    good_config.rewards = ["titanrl.models.tiny:tiny_config"]
    validate(good_config)
    from titanrl.models.tiny import tiny_config as fn

    assert resolve_reward("titanrl.models.tiny:tiny_config", 0) is fn


def test_overrides_parse_each_type():
    """bool/int/float/tuple/None/list/str overrides become values of the field's type."""
    base = RunConfig()
    cfg = apply_overrides(
        base,
        [
            "--train.steps=7",
            "train.optimizer.lr=3e-5",
            "train.optimizer.betas=(0.8,0.95)",
            "train.loss.clip_eps_high=0.28",
            "output.tensorboard=false",
            "rollout.engine.multiprocess=yes",
            "model.dtype=bfloat16",
            "rewards=pkg.mod:a,pkg.mod:b",
            "train.optimizer.grad_clip=2",
        ],
    )
    assert cfg.train.steps == 7 and type(cfg.train.steps) is int
    assert cfg.train.optimizer.lr == 3e-5 and type(cfg.train.optimizer.lr) is float
    assert cfg.train.optimizer.betas == (0.8, 0.95) and isinstance(cfg.train.optimizer.betas, tuple)
    assert cfg.train.loss.clip_eps_high == 0.28
    assert cfg.output.tensorboard is False
    assert cfg.rollout.engine.multiprocess is True
    assert cfg.model.dtype == "bfloat16"
    assert cfg.rewards == ["pkg.mod:a", "pkg.mod:b"]
    assert cfg.train.optimizer.grad_clip == 2.0 and type(cfg.train.optimizer.grad_clip) is float
    again = apply_overrides(cfg, ["train.loss.clip_eps_high=None"])
    assert again.train.loss.clip_eps_high is None
    # Overrides work on a copy: the input config is untouched.
    assert base.train.steps == 100 and base.output.tensorboard is True
    assert cfg.train.loss.clip_eps_high == 0.28


# ----------------------------------------------------------------------------- overrides


def test_unknown_override_key_suggests_close_match():
    """A misspelled key names the key, the section, and a did-you-mean suggestion."""
    with pytest.raises(ConfigError) as info:
        apply_overrides(RunConfig(), ["train.lrr=1e-3"])
    msg = str(info.value)
    assert "'train.lrr'" in msg and "did you mean 'train.optimizer.lr'" in msg


def test_unknown_section_suggests_close_match():
    """A misspelled section is reported with the key it most likely meant (an old name's new one)."""
    with pytest.raises(ConfigError, match=r"did you mean 'train.optimizer.lr'"):
        apply_overrides(RunConfig(), ["trian.lr=1e-3"])


def test_override_into_non_section_fails():
    """`train.optimizer.lr.x=1` names lr as not being a section."""
    with pytest.raises(ConfigError, match=r"train\.optimizer\.lr is not a section"):
        apply_overrides(RunConfig(), ["train.optimizer.lr.x=1"])


@pytest.mark.parametrize("old, new, value", [("train.lr", "train.optimizer.lr", "0.5"),
                                             ("train.loss", "train.loss.objective", "dapo"),
                                             ("rollout.max_new_tokens", "rollout.sampling.max_new_tokens", "7"),
                                             ("reward_timeout_s", "scoring.timeout_s", "5")])
def test_old_flat_names_are_refused_with_their_new_name(old, new, value):
    """A name from before the sections, on the command line, as a constructor keyword or set on a
    config, is refused with its new key instead of being ignored."""
    renamed = f"{old} was renamed to {new}"
    with pytest.raises(ConfigError, match=renamed):
        apply_overrides(RunConfig(), [f"--{old}=1"])
    section, _, name = old.rpartition(".")
    cls = {"train": TrainConfig, "rollout": RolloutConfig, "": RunConfig}[section]
    with pytest.raises(ConfigError, match=renamed):
        cls(**{name: 1})
    with pytest.raises(ConfigError, match=renamed):
        setattr(cls(), name, 1)
    if name not in {f.name for f in dataclasses.fields(cls)}:  # 'train.loss' is now the loss section
        with pytest.raises(AttributeError, match=renamed):
            getattr(cls(), name)
    assert apply_overrides(RunConfig(), [f"--{new}={value}"]) != RunConfig()  # the new key is settable


def test_override_without_equals_fails():
    """An override that is not key=value says what shape it needs."""
    with pytest.raises(ConfigError, match=r"--section\.key=value"):
        apply_overrides(RunConfig(), ["--train.optimizer.lr"])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.optimizer.lr=abc", "train.optimizer.lr='abc' is not a valid float"),
        ("train.steps=1.5", "train.steps='1.5' is not a valid int"),
        ("output.tensorboard=maybe", "output.tensorboard='maybe' is not a valid bool"),
        ("train.optimizer.betas=(0.9)", "train.optimizer.betas='(0.9)' is not a valid"),
        ("train.loss.clip_eps_high=high", "train.loss.clip_eps_high='high' is not a valid float"),
    ],
)
def test_override_wrong_type(override, needle):
    """An override value that does not parse as the field's type names the field and the type."""
    with pytest.raises(ConfigError) as info:
        apply_overrides(RunConfig(), [override])
    assert needle in str(info.value)


# ----------------------------------------------------------------------------- validate


def test_str_assigned_to_int_field(good_config):
    """A str assigned directly to an int field is caught by validate with field and type."""
    good_config.train.steps = "10"
    fails_validation(good_config, "train.steps must be int", "'10'")


def test_bool_is_not_an_int(good_config):
    """True is not accepted where an int is expected (bool is an int subclass in Python)."""
    good_config.rollout.group_size = True
    fails_validation(good_config, "rollout.group_size must be int")


def test_str_assigned_to_float_field(good_config):
    """A str in a float field is caught by validate."""
    good_config.train.optimizer.lr = "abc"
    fails_validation(good_config, "train.optimizer.lr must be float")


def test_wrong_tuple_length(good_config):
    """betas with three elements is rejected."""
    good_config.train.optimizer.betas = (0.9, 0.99, 0.1)
    fails_validation(good_config, "train.optimizer.betas must be")


def test_group_size_below_two(good_config):
    """group_size=1 leaves GRPO nothing to compare; the message says >= 2."""
    good_config.rollout.group_size = 1
    fails_validation(good_config, "rollout.group_size must be >= 2")


@pytest.mark.parametrize(
    "section, name, value",
    [
        ("rollout", "num_workers", 0),
        ("rollout", "prompts_per_step", 0),
        ("rollout.sampling", "max_new_tokens", -1),
        ("train", "steps", 0),
        ("train.optimizer", "lr", 0.0),
        ("train.memory", "micro_batch_size", 0),
        ("train.memory", "logprob_chunk_tokens", 0),
    ],
)
def test_non_positive_fields(good_config, section, name, value):
    """Counts and the learning rate must be > 0; the message names the field."""
    setattr(functools.reduce(getattr, section.split("."), good_config), name, value)
    fails_validation(good_config, f"{section}.{name} must be > 0")


@pytest.mark.parametrize(
    "section, name, value, needle",
    [
        ("rollout.sampling", "temperature", 0.0, "rollout.sampling.temperature must be > 0"),
        ("rollout.sampling", "top_p", 1.5, "rollout.sampling.top_p must be in (0, 1]"),
        ("rollout.sampling", "top_p", 0.0, "rollout.sampling.top_p must be in (0, 1]"),
        ("train", "max_staleness", -1, "train.max_staleness must be >= 0"),
        ("train.memory", "heap_mmap_threshold_mib", -1, "train.memory.heap_mmap_threshold_mib must be >= 0"),
        (
            "train.memory",
            "activation_checkpointing_every",
            0,
            "train.memory.activation_checkpointing_every must be >= 1",
        ),
        (
            "train.memory",
            "activation_checkpointing",
            "some",
            "train.memory.activation_checkpointing must be 'auto', 'none', 'full' or",
        ),
        ("model", "dtype", "float16", "model.dtype must be 'float32' or 'bfloat16'"),
    ],
)
def test_out_of_range_values(good_config, section, name, value, needle):
    """Values of the right type but outside their range are rejected by name."""
    setattr(functools.reduce(getattr, section.split("."), good_config), name, value)
    fails_validation(good_config, needle)


def test_missing_checkpoint_setting(good_config):
    """An empty model.checkpoint says to set it to an HF checkpoint directory."""
    good_config.model.checkpoint = ""
    fails_validation(good_config, "model.checkpoint is empty", "HF checkpoint directory")


def test_checkpoint_dir_does_not_exist(good_config, tmp_path):
    """A checkpoint path that does not exist is named in the error."""
    good_config.model.checkpoint = str(tmp_path / "nope")
    fails_validation(good_config, "model.checkpoint", "nope", "does not exist")


def test_checkpoint_dir_without_config_json(good_config, tmp_path):
    """A directory with no config.json is not an HF checkpoint."""
    empty = tmp_path / "empty_ckpt"
    empty.mkdir()
    good_config.model.checkpoint = str(empty)
    fails_validation(good_config, "model.checkpoint", "config.json")


def test_checkpoint_config_json_corrupt(good_config, tmp_path):
    """A config.json that is not JSON is reported as such."""
    bad = tmp_path / "bad_ckpt"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    good_config.model.checkpoint = str(bad)
    fails_validation(good_config, "model.checkpoint", "not valid JSON")


def test_train_file_empty_setting(good_config):
    """An unset data.train_file says to set it."""
    good_config.data.train_file = ""
    fails_validation(good_config, "data.train_file is empty")


def test_train_file_missing(good_config, tmp_path):
    """A train file that does not exist is named."""
    good_config.data.train_file = str(tmp_path / "missing.jsonl")
    fails_validation(good_config, "data.train_file", "missing.jsonl", "does not exist")


def test_eval_file_missing(good_config, tmp_path):
    """An eval file that does not exist is named (eval_file is optional but must exist if set)."""
    good_config.data.eval_file = str(tmp_path / "eval_missing.jsonl")
    fails_validation(good_config, "data.eval_file", "eval_missing.jsonl")


def test_train_file_is_a_directory(good_config, tmp_path):
    """A directory is not a dataset file."""
    good_config.data.train_file = str(tmp_path)
    fails_validation(good_config, "data.train_file")


def test_no_rewards(good_config):
    """A run without rewards is rejected with the expected reward signature."""
    good_config.rewards = []
    fails_validation(good_config, "rewards is empty", "reward(prompt, completion")


def test_reward_not_callable(good_config):
    """A non-callable reward is named by its index and the signature it needs."""
    good_config.rewards = [length_reward, 42]
    fails_validation(good_config, "rewards[1] must be callable", "42")


@pytest.mark.parametrize(
    "spec",
    ["no_such_module_xyz:reward", "titanrl.config:no_such_function", "titanrl.config"],
)
def test_reward_string_not_importable(good_config, spec):
    """A 'module:function' string that cannot be imported names itself and the expected form."""
    good_config.rewards = [spec]
    fails_validation(good_config, "rewards[0]", repr(spec), "cannot be imported", "'package.module:function'")


def test_reward_string_names_non_callable(good_config):
    """A 'module:attr' string naming a non-callable (a constant) is rejected as not callable."""
    good_config.rewards = ["titanrl.models.tiny:EOS_TOKEN_ID"]
    fails_validation(good_config, "rewards[0] must be callable")


def test_not_a_run_config():
    """validate rejects objects that are not a RunConfig."""
    with pytest.raises(ConfigError, match="expected a titanrl.RunConfig"):
        validate({"model": {}})


def test_section_replaced_by_wrong_type(good_config):
    """A whole section replaced by a non-dataclass is a type error naming the section."""
    good_config = dataclasses.replace(good_config, train="fast")
    fails_validation(good_config, "train must be TrainConfig")


# ----------------------------------------------------------------------------- driver + CLI


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if anything tries to start Ray; afterwards Ray must not be running
    (unless an earlier test in the session left it running, which this test did not cause)."""
    import ray

    import titanrl.driver.train

    was_running = ray.is_initialized()

    def forbidden(*args, **kwargs):
        raise AssertionError("Ray was started although the config is invalid")

    monkeypatch.setattr(ray, "init", forbidden)
    for name in ("init_ray", "_init_ray"):  # the driver's Ray start-up helper, whatever its name
        if hasattr(titanrl.driver.train, name):
            monkeypatch.setattr(titanrl.driver.train, name, forbidden)
    yield
    assert was_running or not ray.is_initialized()


def test_driver_train_validates_before_ray(good_config, tmp_path, no_ray):
    """titanrl.driver.train.train raises the config error for a missing train file without starting Ray."""
    from titanrl.driver.train import train

    good_config.data.train_file = str(tmp_path / "missing.jsonl")
    good_config.output.dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="data.train_file"):
        train(good_config)
    assert not (tmp_path / "run").exists()  # nothing was written


def test_driver_train_bad_dataset_before_ray(good_config, tmp_path, no_ray):
    """An existing but empty train file fails in train() (DatasetError) before Ray starts."""
    from titanrl.data import DatasetError
    from titanrl.driver.train import train

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    good_config.data.train_file = str(empty)
    good_config.output.dir = str(tmp_path / "run")
    with pytest.raises(DatasetError, match="has no rows"):
        train(good_config)
    assert not (tmp_path / "run").exists()


def _write_config_file(tmp_path, checkpoint_dir, train_file: str, body: str | None = None):
    path = tmp_path / "my_config.py"
    if body is None:
        body = f"""
            from titanrl import RunConfig, ModelConfig, DataConfig

            def reward(prompt, completion, **fields):
                return 1.0

            config = RunConfig(
                model=ModelConfig(checkpoint={str(checkpoint_dir)!r}),
                data=DataConfig(train_file={train_file!r}),
                rewards=[reward],
            )
        """
    path.write_text(textwrap.dedent(body))
    return path


def test_cli_unknown_override_exits_2(tmp_path, checkpoint_dir, capsys, no_ray):
    """`titanrl train CFG --train.lrr=1` exits 2, printing 'config error' naming the key, no Ray."""
    from titanrl.cli import main

    cfg = _write_config_file(tmp_path, checkpoint_dir, str(tmp_path / "train.jsonl"))
    code = main(["train", str(cfg), "--out", str(tmp_path / "run"), "--train.lrr=1e-3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "config error" in err and "train.lrr" in err and "did you mean 'train.optimizer.lr'" in err


def test_cli_validate_error_exits_2(tmp_path, checkpoint_dir, capsys, no_ray):
    """A config file whose train file is missing exits 2 with the field named, without Ray."""
    from titanrl.cli import main

    cfg = _write_config_file(tmp_path, checkpoint_dir, str(tmp_path / "nowhere.jsonl"))
    code = main(["train", str(cfg), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert "config error" in err and "data.train_file" in err and "nowhere.jsonl" in err


def test_cli_override_applied_before_validate(tmp_path, checkpoint_dir, capsys):
    """An override is applied before validation: a bad group_size from the CLI is what's reported."""
    from titanrl.cli import main

    cfg = _write_config_file(tmp_path, checkpoint_dir, str(tmp_path / "nowhere.jsonl"))
    code = main(["train", str(cfg), "--rollout.group_size=1"])
    assert code == 2
    assert "rollout.group_size must be >= 2" in capsys.readouterr().err


def test_cli_config_file_without_config(tmp_path, capsys):
    """A config file that defines neither `config` nor `make_config` gets a clear error, exit 2."""
    from titanrl.cli import main

    cfg = _write_config_file(tmp_path, None, "", body="x = 1\n")
    code = main(["train", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2
    assert "config error" in err and "must define `config = RunConfig(...)`" in err


def test_cli_config_of_wrong_type(tmp_path, capsys):
    """`config` that is not a RunConfig is named with its actual type."""
    from titanrl.cli import main

    cfg = _write_config_file(tmp_path, None, "", body="config = {'train': {}}\n")
    code = main(["train", str(cfg)])
    err = capsys.readouterr().err
    assert code == 2 and "must be a titanrl.RunConfig, got dict" in err


def test_cli_missing_config_file(tmp_path, capsys):
    """A config path that does not exist exits 2 naming the path."""
    from titanrl.cli import main

    code = main(["train", str(tmp_path / "absent.py")])
    err = capsys.readouterr().err
    assert code == 2 and "absent.py" in err and "does not exist" in err


def test_checkpoint_without_weights_or_tokenizer(good_config, tmp_path, checkpoint_dir):
    """A checkpoint directory with config.json but no weights (or no tokenizer) fails at validate time."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(checkpoint_dir / "config.json", bare / "config.json")
    good_config.model.checkpoint = str(bare)
    fails_validation(good_config, "model.checkpoint", "model.safetensors")
    shutil.copy(checkpoint_dir / "model.safetensors", bare / "model.safetensors")
    fails_validation(good_config, "model.checkpoint", "tokenizer")


def test_clip_range_and_token_budget(good_config):
    """clip_eps outside (0, 1) and completions that cannot fit max_model_len are rejected."""
    good_config.train.loss.clip_eps = 1.5
    fails_validation(good_config, "train.loss.clip_eps")
    good_config.train.loss.clip_eps = 0.2
    good_config.rollout.sampling.max_new_tokens = good_config.rollout.engine.max_model_len
    fails_validation(good_config, "rollout.sampling.max_new_tokens", "max_model_len")


def test_env_factory_is_validated(good_config):
    """env.factory must be importable and callable; with an env, rewards become optional."""
    good_config.env.factory = "no_such_module:make_env"
    fails_validation(good_config, "env.factory", "cannot be imported")
    good_config.env.factory = 42
    fails_validation(good_config, "env.factory", "make_env(context)")
    good_config.env.factory = "titanrl.envs.base:EnvContext"  # any callable passes validation
    good_config.rewards = []
    validate(good_config)
    good_config.env.max_turns = 0
    fails_validation(good_config, "env.max_turns")


def test_auto_resume_needs_checkpoints(good_config):
    """train.auto_resume resumes from the newest checkpoint: without output.save_every_steps there
    would be none, so it is refused before start-up, naming the setting."""
    good_config.train.auto_resume = True
    fails_validation(good_config, "train.auto_resume", "output.save_every_steps >= 1")
    good_config.output.save_every_steps = 1
    validate(good_config)


def test_elastic_workers_need_continuous_mode(good_config):
    """rollout.elastic changes the worker count mid-run, which lock-step's fixed split cannot take,
    nor the busy flags (one byte per starting worker): both refused, naming the settings."""
    good_config.rollout.elastic = True
    fails_validation(good_config, "rollout.elastic", "rollout.continuous=true")
    good_config.rollout.continuous = True
    validate(good_config)
    good_config.train.compute.threads_when_rollouts_idle = 1
    fails_validation(good_config, "rollout.elastic", "threads_when_rollouts_idle")
