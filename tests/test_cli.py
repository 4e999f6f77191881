"""The `titanrl` command line: overrides of every field type, `train --help`, train's exit codes
and `--resume`, `export` of training checkpoints to HF (loaded by transformers and by vLLM's
own Qwen3), `eval` (greedy accuracy and pass@k) and `plot`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import textwrap
from pathlib import Path

import pytest
import torch

import titanrl
from titanrl.cli import main, one_line_reason, split_overrides
from titanrl.commands.evaluate import pass_at_k
from titanrl.config import ConfigError, RunConfig, apply_overrides
from titanrl.config.values import show
from titanrl.models.hf_checkpoint import hf_state_dict, read_state_dict
from titanrl.rundir.checkpoints import writing_checkpoint
from titanrl.trainer.setup import TrainerSetup

# ----------------------------------------------------------------------------- overrides


def test_override_parses_every_field_type():
    """int, float, str, bool, `X | None`, tuples, lists and `Any` fields each get a value of their type."""
    cfg = apply_overrides(
        RunConfig(),
        [
            "--rollout.group_size=16",
            "--train.optimizer.lr=3e-4",
            "--model.dtype=bfloat16",
            "--output.progress_bar=off",
            "--train.loss.clip_eps_high=null",
            "--scoring.timeout_s=none",
            "--train.optimizer.betas=0.9,0.95",
            "--rewards=pkg.mod:fn,pkg.mod:fn2",
            "--env.factory=pkg.mod:make_env",
            "--seed=7",
            "--data.eval_file=",
            "--train.optimizer.grad_clip=2",
        ],
    )
    assert cfg.rollout.group_size == 16 and type(cfg.rollout.group_size) is int
    assert cfg.train.optimizer.lr == 3e-4 and type(cfg.train.optimizer.lr) is float
    assert cfg.model.dtype == "bfloat16"
    assert cfg.output.progress_bar is False
    assert cfg.train.loss.clip_eps_high is None and cfg.scoring.timeout_s is None
    assert cfg.train.optimizer.betas == (0.9, 0.95) and type(cfg.train.optimizer.betas) is tuple
    assert all(type(b) is float for b in cfg.train.optimizer.betas)
    assert cfg.rewards == ["pkg.mod:fn", "pkg.mod:fn2"]
    assert cfg.env.factory == "pkg.mod:make_env"
    assert cfg.seed == 7 and cfg.data.eval_file == ""
    assert cfg.train.optimizer.grad_clip == 2.0 and type(cfg.train.optimizer.grad_clip) is float
    again = apply_overrides(
        cfg, ["env.factory=none", "scoring.timeout_s=12.5", "train.optimizer.betas=[0.8, 0.9]", "rewards=", "seed=-1"]
    )
    assert again.env.factory is None and again.scoring.timeout_s == 12.5
    assert again.train.optimizer.betas == (0.8, 0.9) and again.rewards == [] and again.seed == -1


def _leaves(obj, prefix=""):
    """(dotted key, default value, owning dataclass, field name) of every settable field, sections flattened."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value, type(obj), f.name


def test_every_config_field_round_trips_through_an_override():
    """Each field of RunConfig (all sections) set on the command line to its default's text (as
    --help shows it) gets back exactly its default, with the same type: no field is unreachable
    from the CLI."""
    base = RunConfig()
    for key, default, _, _ in _leaves(base):
        cfg = apply_overrides(base, [f"--{key}={show(default)}"])
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == default and type(obj) is type(default), key


def _literal_fields():
    """(dotted key, allowed values) of every Literal-typed field of RunConfig."""
    import typing

    out = []
    for key, _, cls, name in _leaves(RunConfig()):
        hint = typing.get_type_hints(cls)[name]
        if typing.get_origin(hint) is typing.Literal:
            out.append((key, typing.get_args(hint)))
    return out


def test_string_choices_are_literal_types():
    """The string settings with a fixed set of values are Literal types (tyro turns them into choices)."""
    keys = {key for key, _ in _literal_fields()}
    assert keys == {
        "model.dtype",
        "data.on_overlong",
        "rollout.on_weight_update",
        "rollout.weight_transport",
        "rollout.sampling.logprobs",
        "train.lr_schedule.decay",
        "train.compute.device",
        "train.parallel.pp_schedule",
        "train.memory.activation_checkpointing",
        "train.moe.load_balance",
        "output.wandb_mode",
        "train.kl.estimator",
        "train.loss.objective",
        "train.off_policy.correction",
        "train.compute.cpu_matmul",
        "lora.sync",
    }


@pytest.mark.parametrize("key, allowed", _literal_fields())
def test_literal_override_outside_its_choices_names_field_and_choices(key, allowed):
    """`--train.compute.device=tpu` (and a bad value for every other Literal field) is a ConfigError naming
    the field, the value and every allowed value; each allowed value is accepted."""
    with pytest.raises(ConfigError) as info:
        apply_overrides(RunConfig(), [f"--{key}=tpu"])
    assert f"{key}='tpu' is not one of " + ", ".join(map(repr, allowed)) in str(info.value)
    for value in allowed:
        obj = apply_overrides(RunConfig(), [f"--{key}={value}"])
        for part in key.split("."):
            obj = getattr(obj, part)
        assert obj == value


@pytest.mark.parametrize("key, allowed", _literal_fields())
def test_literal_field_set_in_python_is_refused_by_validate(key, allowed):
    """A CONFIG.py that sets a Literal field to another string gets a ConfigError from `validate`
    naming the field and the allowed values (tyro passes such a default through untouched)."""
    from titanrl.config import validate

    cfg = apply_overrides(RunConfig(), ["seed=1"])
    *path, name = key.split(".")
    section = cfg
    for part in path:
        section = getattr(section, part)
    setattr(section, name, "tpu")
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    quoted = [repr(a) for a in allowed]
    assert f"{key} must be {', '.join(quoted[:-1])} or {quoted[-1]}, got str 'tpu'" in str(info.value)


@pytest.mark.parametrize(
    "override, needles",
    [
        ("--rollout.group_size=1.5", ["rollout.group_size='1.5'", "int"]),
        ("--train.optimizer.lr=fast", ["train.optimizer.lr='fast'", "float"]),
        ("--output.tensorboard=maybe", ["output.tensorboard='maybe'", "bool", "true/false"]),
        ("--train.optimizer.betas=0.9", ["train.optimizer.betas='0.9'", "tuple of 2", "float"]),
        ("--train.optimizer.betas=0.9,0.95,0.99", ["train.optimizer.betas=", "tuple of 2"]),
        ("--train.optimizer.betas=0.9,x", ["train.optimizer.betas='0.9,x'", "tuple of 2"]),
        ("--train.loss.clip_eps_high=high", ["train.loss.clip_eps_high='high'", "float", "or none"]),
        ("--scoring.timeout_s=soon", ["scoring.timeout_s='soon'", "float", "or none"]),
        ("--seed=none", ["seed='none'", "int"]),
    ],
)
def test_override_bad_value_names_key_and_type(override, needles):
    """A value that does not parse as its field's type is a ConfigError naming the key and the expected type."""
    with pytest.raises(ConfigError) as info:
        apply_overrides(RunConfig(), [override])
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_override_of_a_whole_section_is_refused():
    """`--train=3` names train as a section and shows how to set one of its fields."""
    with pytest.raises(ConfigError, match=r"'train' is a section.*--train\.steps="):
        apply_overrides(RunConfig(), ["--train=3"])


def test_split_overrides_takes_both_forms():
    """`--k=v` and `--k v` become overrides; the command's own options and positionals stay, in order,
    so a value like 3e-4 is never taken for the config path."""
    own, overrides = split_overrides(
        ["train", "--train.optimizer.lr", "3e-4", "cfg.py", "--out", "runs/x", "--seed=3", "--resume",
         "--train.optimizer.betas", "0.9,0.95"],
        {"--out", "--resume", "-h", "--help"},
    )
    assert own == ["train", "cfg.py", "--out", "runs/x", "--resume"]
    assert overrides == ["--train.optimizer.lr=3e-4", "--seed=3", "--train.optimizer.betas=0.9,0.95"]


# ----------------------------------------------------------------------------- train --help


def test_train_help_lists_every_field_with_type_default_and_docstring(capsys):
    """`titanrl train --help` shows every config field as --section.key / --key with its type,
    default and docstring (tyro reads the docstrings from config/schema.py), Literal fields with
    their choices, in lines of at most 100 columns."""
    from tyro._docstrings import get_field_docstring

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    blocks = {}  # '--key' -> the help text up to the next option
    for block in out.split("\n  --")[1:]:
        name, _, rest = block.partition(" ")
        blocks["--" + name] = " ".join(rest.split())
    for key, default, cls, name in _leaves(RunConfig()):
        doc = get_field_docstring(cls, name, ())
        assert doc, f"{key} has no docstring in config/schema.py"
        assert f"--{key}" in blocks, key
        assert " ".join(doc.split()[:6]) in blocks[f"--{key}"], key
        assert "(default: " in blocks[f"--{key}"], key
    assert "  --train.optimizer.lr FLOAT\n        AdamW learning rate. (default: 0.0001)" in out
    assert "  --train.optimizer.betas FLOAT,FLOAT\n        AdamW betas. (default: 0.9,0.99)" in out
    assert "  --scoring.timeout_s FLOAT|none\n" in out
    assert "  --env.factory MODULE:FUNCTION|none\n" in out
    assert "  --output.tensorboard {true,false}\n" in out
    assert "  --train.compute.device {auto,cpu,cuda,xla}\n" in out
    assert "--resume" in out and "--out RUN_DIR" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_train_help_shows_the_config_files_values_as_defaults(tmp_path, capsys):
    """`titanrl train CONFIG.py --help` shows CONFIG.py's values as the defaults the overrides apply to."""
    cfg = _write_config(tmp_path, """
        from titanrl import ComputeConfig, OptimizerConfig, TrainConfig

        def my_reward(prompt, completion, **fields):
            return 0.0

        config = RunConfig(train=TrainConfig(optimizer=OptimizerConfig(lr=0.123), compute=ComputeConfig(device="cpu")),
                           rewards=[my_reward])
    """)
    assert main(["train", str(cfg), "--help"]) == 0
    out = capsys.readouterr().out
    assert "AdamW learning rate. (default: 0.123)" in out
    assert "(default: cpu)" in out and "my_reward (default:" not in out
    assert ":my_reward)" in out  # a callable reward shows as module:function


# ----------------------------------------------------------------------------- train


def _write_config(tmp_path: Path, body: str = "config = RunConfig()\n") -> Path:
    path = tmp_path / "cfg.py"
    path.write_text("from titanrl import RunConfig\n" + textwrap.dedent(body))
    return path


@dataclasses.dataclass
class _FakeResult:
    run_dir: Path
    final_checkpoint: Path | None
    metrics: list


@pytest.fixture
def driver_calls(monkeypatch):
    """Replaces titanrl.driver.train.train (only) with a recorder; the test sets what it does via `behaviour`."""
    import titanrl.driver.train

    calls: list[tuple[RunConfig, bool]] = []
    behaviour: dict = {}

    def fake_train(config: RunConfig, resume: bool = False):
        calls.append((config, resume))
        if "raise" in behaviour:
            raise behaviour["raise"]
        return _FakeResult(Path(config.output.dir), None, [{"step": 1, "time/elapsed_s": 6.0}])

    monkeypatch.setattr(titanrl.driver.train, "train", fake_train)
    return calls, behaviour


def test_train_resume_passes_through_with_overrides(tmp_path, driver_calls, capsys):
    """`titanrl train CFG --out DIR --resume --train.steps 50` calls driver.train(config, resume=True)
    with output.dir=DIR and the override applied; exit 0 with the run summary."""
    calls, _ = driver_calls
    cfg = _write_config(tmp_path)
    code = main(["train", str(cfg), "--out", str(tmp_path / "run"), "--resume", "--train.steps", "50"])
    assert code == 0
    ((config, resume),) = calls
    assert resume is True and config.output.dir == str(tmp_path / "run") and config.train.steps == 50
    assert f"run directory: {tmp_path / 'run'}" in capsys.readouterr().out
    calls.clear()
    assert main(["train", str(cfg), "--out", str(tmp_path / "run2")]) == 0
    assert calls[0][1] is False


def test_titanrl_train_passes_resume(driver_calls):
    """`titanrl.train(config, resume=True)` reaches the driver with resume=True (and False by default)."""
    calls, _ = driver_calls
    titanrl.train(RunConfig(), resume=True)
    titanrl.train(RunConfig())
    assert [r for _, r in calls] == [True, False]


@pytest.mark.parametrize(
    "error, code, stderr",
    [
        (RuntimeError("reward errors in 80% of samples at step 7\nsecond line"), 1,
         "titanrl: run stopped: RuntimeError: reward errors in 80% of samples at step 7\n"),
        (ConfigError("output.dir 'x' already holds a run"), 2,
         "titanrl: config error: output.dir 'x' already holds a run\n"),
        (KeyboardInterrupt(), 130, "titanrl: interrupted\n"),
    ],
)
def test_train_exit_codes(tmp_path, driver_calls, capsys, error, code, stderr):
    """A run that raises exits 1 with one line of reason; a config error 2; Ctrl-C 130."""
    _, behaviour = driver_calls
    behaviour["raise"] = error
    assert main(["train", str(_write_config(tmp_path)), "--out", str(tmp_path / "run")]) == code
    assert capsys.readouterr().err == stderr


def test_one_line_reason_unwraps_ray_errors():
    """An actor's exception, wrapped by Ray with its traceback (and by the driver's RunStopped), is
    reported by its own type and first line; a RunStopped of the driver's own is its message."""
    from ray.exceptions import RayTaskError

    traceback = "Traceback (most recent call last):\n  ..."
    wrapped = RayTaskError("GRPOTrainer.step", traceback, ValueError("loss is nan\nx"))
    assert one_line_reason(wrapped) == "ValueError: loss is nan"
    assert one_line_reason(wrapped.as_instanceof_cause()) == "ValueError: loss is nan"
    assert one_line_reason(OSError()) == "OSError"
    try:
        try:
            raise wrapped.as_instanceof_cause()
        except Exception as e:
            raise titanrl.RunStopped(f"{type(e).__name__}: {e}; step 3 saved in run/checkpoints/step_000003") from e
    except titanrl.RunStopped as stopped:
        assert one_line_reason(stopped) == "ValueError: loss is nan"
    own = titanrl.RunStopped("reward errors in 9 of 16 samples at step 4 (max_reward_error_frac 0.5)")
    assert one_line_reason(own) == "reward errors in 9 of 16 samples at step 4 (max_reward_error_frac 0.5)"


def test_unknown_argument_and_missing_config(tmp_path, capsys):
    """An unknown option of `export` is argparse's usage error (2); a missing CONFIG.py is a config error (2)."""
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "o"), "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "absent.py")]) == 2
    assert "absent.py" in capsys.readouterr().err


def test_train_refuses_a_bad_choice_before_the_driver(tmp_path, driver_calls, capsys):
    """`titanrl train CFG --train.compute.device tpu` exits 2 naming the field and the allowed devices; the
    driver is never called."""
    calls, _ = driver_calls
    assert main(["train", str(_write_config(tmp_path)), "--train.compute.device", "tpu"]) == 2
    assert (
        "titanrl: config error: train.compute.device='tpu' is not one of 'auto', 'cpu', 'cuda'"
        in capsys.readouterr().err
    )
    assert calls == []


# ----------------------------------------------------------------------------- export


STEPS = (2, 4)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory holding two real training checkpoints (steps 2 and 4) written by
    GRPOTrainer.save_state, each after perturbing the weights differently; returns the run
    directory, the initial HF checkpoint and the HF state of the policy at each step."""
    from titanrl.config import ModelConfig, TrainConfig
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer import GRPOTrainer

    root = tmp_path_factory.mktemp("trained_run")
    initial = write_tiny_checkpoint(root / "initial", seed=3, std=0.1)
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(initial)), TrainConfig(), temperature=1.0, seed=0))
    run_dir = root / "run"
    states = {}
    gen = torch.Generator().manual_seed(0)
    for step in STEPS:
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        states[step] = {k: v.clone() for k, v in hf_state_dict(trainer.model).items()}
        with writing_checkpoint(run_dir, step, manifest={"policy_version": step}) as ckpt:
            trainer.save_state(str(ckpt / "trainer"))
    return run_dir, initial, states


def _assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_export_newest_checkpoint_loads_in_transformers(trained_run, tmp_path, capsys):
    """`titanrl export RUN --hf OUT` writes the newest checkpoint's policy: transformers'
    Qwen3ForCausalLM.from_pretrained(OUT) holds exactly those weights, with the tokenizer alongside."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    run_dir, _, states = trained_run
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--hf", str(out)]) == 0
    assert "training checkpoint of step 4" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    _assert_state_equal(read_state_dict(out), states[4])
    model = Qwen3ForCausalLM.from_pretrained(str(out))
    loaded = model.state_dict()
    for k, v in states[4].items():
        assert torch.equal(loaded[k], v), k
    assert torch.equal(loaded["lm_head.weight"], states[4]["model.embed_tokens.weight"])  # tied head
    assert AutoTokenizer.from_pretrained(str(out))("1+1=")["input_ids"]


def test_export_step_and_refusals(trained_run, tmp_path, capsys):
    """--step N picks that checkpoint; a step without one lists the steps that exist (exit 2);
    a non-empty OUT is refused and left untouched (exit 2); an empty OUT directory is used."""
    run_dir, _, states = trained_run
    out = tmp_path / "empty_dir"
    out.mkdir()
    assert main(["export", str(run_dir), "--step", "2", "--hf", str(out)]) == 0
    _assert_state_equal(read_state_dict(out), states[2])

    assert main(["export", str(run_dir), "--step", "3", "--hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 3" in err and "[2, 4]" in err
    assert not (tmp_path / "x").exists()

    before = (out / "model.safetensors").read_bytes()
    assert main(["export", str(run_dir), "--hf", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_export_final_policy(tmp_path, trained_run, capsys):
    """A run with no training checkpoint but final/ exports a copy of final/; a run with final/ written
    after its last training checkpoint (train.steps in config.json) exports final/; a directory with
    neither is an error naming both (exit 2)."""
    import shutil

    _, initial, _ = trained_run
    run = tmp_path / "run"
    shutil.copytree(initial, run / "final")
    assert main(["export", str(run), "--hf", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (initial / "model.safetensors").read_bytes()

    later = tmp_path / "later_run"
    shutil.copytree(trained_run[0], later)
    shutil.copytree(initial, later / "final")
    (later / "config.json").write_text(json.dumps({"train": {"steps": 5}}))
    assert main(["export", str(later), "--hf", str(tmp_path / "b")]) == 0
    assert "final policy of step 5" in capsys.readouterr().out
    # An explicit step still picks its training checkpoint.
    assert main(["export", str(later), "--step", "4", "--hf", str(tmp_path / "c")]) == 0
    _assert_state_equal(read_state_dict(tmp_path / "c"), trained_run[2][4])

    (tmp_path / "nothing").mkdir()
    assert main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "no training checkpoint" in err and "final/" in err


@pytest.mark.slow
@pytest.mark.own_vllm_engine
def test_exported_checkpoint_runs_in_vllm_builtin_qwen3(trained_run, tmp_path, monkeypatch):
    """vLLM's own Qwen3ForCausalLM (plain `vllm.LLM(model=OUT)`, in-process) loads an exported
    checkpoint and its greedy tokens equal a greedy decode with our PyTorch model on the same weights."""
    from vllm import LLM, SamplingParams

    from titanrl.commands.export import export_run
    from titanrl.models.hf_checkpoint import load_model

    run_dir, _, _ = trained_run
    out = tmp_path / "hf"
    export_run(run_dir, out)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it in this process
    llm = LLM(model=str(out), tokenizer=str(out), dtype="float32", max_model_len=64, enforce_eager=True,
              kv_cache_memory_bytes=2**28, max_num_seqs=4, seed=0)
    try:
        arch = llm.collective_rpc(lambda worker: type(worker.get_model()).__name__)[0]
        (result,) = llm.generate(["12+34="], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.set_num_threads = set_num_threads
    assert arch == "Qwen3ForCausalLM"
    tokens = list(result.outputs[0].token_ids)
    assert len(tokens) == 8
    model, _ = load_model(out)
    seq = list(result.prompt_token_ids)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert seq[len(result.prompt_token_ids):] == tokens


# ----------------------------------------------------------------------------- eval


def test_pass_at_k_matches_enumeration():
    """The unbiased estimator equals the fraction of all k-subsets of n samples that hold a pass."""
    for n, k in [(1, 1), (4, 1), (4, 2), (5, 3), (6, 6)]:
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n = k: any-correct
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_eval_checkpoint_argument_forms(trained_run, tmp_path):
    """eval's CHECKPOINT may be an HF directory (used as is), a run's `checkpoints/step_N` or its
    `trainer/` (exported to scratch), or a run directory (its newest policy); anything else is refused."""
    from titanrl.commands import CommandError
    from titanrl.commands.evaluate import resolve_hf_checkpoint

    run_dir, initial, states = trained_run
    assert resolve_hf_checkpoint(initial, tmp_path / "s0") == initial
    step2 = run_dir / "checkpoints" / "step_000002"
    for i, (arg, step) in enumerate([(step2, 2), (step2 / "trainer", 2), (run_dir, 4)]):
        hf = resolve_hf_checkpoint(arg, tmp_path / f"s{i + 1}")
        assert hf.parent == tmp_path / f"s{i + 1}"
        _assert_state_equal(read_state_dict(hf), states[step])
    with pytest.raises(CommandError, match="not an HF checkpoint directory"):
        resolve_hf_checkpoint(tmp_path, tmp_path / "s9")
    with pytest.raises(CommandError, match="does not exist"):
        resolve_hf_checkpoint(tmp_path / "absent", tmp_path / "s9")


def _eval_config(tmp_path: Path, checkpoint: Path, eval_file: str, log: Path) -> Path:
    return _write_config(tmp_path, f"""
        import json
        from titanrl import DataConfig, EngineConfig, EvalConfig, ModelConfig, RolloutConfig, SamplingConfig

        def reward(prompt, completion, label, **fields):
            with open({str(log)!r}, "a") as f:
                f.write(json.dumps({{"prompt": prompt, "completion": completion}}) + "\\n")
            return float(label)

        config = RunConfig(
            model=ModelConfig(checkpoint={str(checkpoint)!r}),
            data=DataConfig(eval_file={eval_file!r}),
            rollout=RolloutConfig(sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
                                  engine=EngineConfig(max_model_len=64, max_num_seqs=32)),
            eval=EvalConfig(max_prompts=100, correct_threshold=1.0),
            rewards=[reward],
        )
    """)


def test_eval_refuses_bad_input_before_starting(tmp_path, trained_run, capsys):
    """A config with no data.eval_file, or --samples below --k (or without it), is refused before any
    engine starts (exit 2, saying what to set)."""
    cfg = _eval_config(tmp_path, trained_run[1], "", tmp_path / "log.jsonl")
    assert main(["eval", str(trained_run[1]), "--config", str(cfg)]) == 2
    assert "no data.eval_file" in capsys.readouterr().err
    cfg = _eval_config(tmp_path, trained_run[1], str(tmp_path / "eval.jsonl"), tmp_path / "log.jsonl")
    assert main(["eval", str(trained_run[1]), "--config", str(cfg), "--k", "4", "--samples", "2"]) == 2
    assert "--samples (2) must be >= --k (4)" in capsys.readouterr().err
    assert main(["eval", str(trained_run[1]), "--config", str(cfg), "--samples", "2"]) == 2
    assert "pass --k K with it" in capsys.readouterr().err


@pytest.mark.own_vllm_engine
def test_eval_training_checkpoint_accuracy_and_pass_at_k(tmp_path, trained_run, capsys):
    """`titanrl eval RUN/checkpoints/step_4 --config CFG --k 2 --samples 4 --eval.max_prompts=6` scores
    the first 6 eval rows: greedy accuracy and pass@2 equal the labelled fraction (a row whose reward
    raises counts as failing and as a reward error), each prompt got one greedy completion and 4
    distinct sampled ones (at most 6 tokens), and the last line is the JSON summary."""
    from titanrl.data import write_rows

    run_dir, _, _ = trained_run
    rows = [{"prompt": f"{i}+{i}=", "label": int(i in (0, 2, 5, 7))} for i in range(8)]
    rows[4]["label"] = "boom"  # float("boom") raises: a reward error, scored as failing
    write_rows(tmp_path / "eval.jsonl", rows)
    log = tmp_path / "log.jsonl"
    cfg = _eval_config(tmp_path, Path("/nonexistent"), str(tmp_path / "eval.jsonl"), log)
    ckpt = run_dir / "checkpoints" / "step_000004"
    code = main(["eval", str(ckpt), "--config", str(cfg), "--k", "2", "--samples", "4", "--eval.max_prompts", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == {
        "checkpoint": str(ckpt), "accuracy": 0.5, "pass@k": 0.5, "k": 2, "prompts": 6, "samples": 4,
        "reward_mean": 0.5, "sample_accuracy": 0.5, "reward_errors": 1 + 4,
    }
    table = {line.rsplit("  ", 1)[0].strip(): line.rsplit("  ", 1)[1].strip() for line in out.splitlines()[:-1]}
    assert table["greedy accuracy (reward >= 1)"] == "50.0%" and table["pass@2 (4 samples/prompt, T=1)"] == "50.0%"
    assert table["prompts"] == "6" and table["checkpoint"] == str(ckpt)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 6 + 6 * 4
    # Greedy first (rewards of one request run concurrently, so in any order within it).
    assert sorted(c["prompt"] for c in calls[:6]) == sorted(r["prompt"] for r in rows[:6])
    for row in rows[:6]:
        sampled = [c["completion"] for c in calls[6:] if c["prompt"] == row["prompt"]]
        assert len(sampled) == 4 and len(set(sampled)) > 1  # seeded but not one stream
    assert all(len(c["completion"]) <= 6 for c in calls)  # byte tokenizer: a token is at most one character


# ----------------------------------------------------------------------------- plot


def test_plot_redraws_progress_png(tmp_path, capsys):
    """`titanrl plot RUN_DIR` draws progress.png (a PNG) from metrics.jsonl and prints its path."""
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": 0, "eval/accuracy": 0.2}] + [{"step": s, "reward/mean": s / 10} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "progress.png")
    assert (run / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_metrics_is_a_clear_error(tmp_path, capsys):
    """A directory with no (or an empty, or a corrupt) metrics.jsonl exits 2 naming the problem; nothing is drawn."""
    assert main(["plot", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "is empty" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl:2 is not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "progress.png").exists()


def test_configs_in_different_folders_import_their_own_neighbours(tmp_path):
    """Two config files whose folders both have a `task.py`: loading the second in the same
    process gets its own `task`, not the first one's cached module."""
    from titanrl.cli import load_config_file

    checkpoints = []
    for name in ("first", "second"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "task.py").write_text(f"CHECKPOINT = {str(tmp_path / name)!r}\n")
        (folder / "config.py").write_text(
            "import titanrl\nfrom task import CHECKPOINT\n"
            "config = titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint=CHECKPOINT))\n"
        )
        checkpoints.append(load_config_file(str(folder / "config.py")).model.checkpoint)
    assert checkpoints == [str(tmp_path / "first"), str(tmp_path / "second")]
