"""Command line: `titanrl train CONFIG.py --out DIR [--section.key=value ...]`.

CONFIG.py is a Python file that defines `config`, a `titanrl.RunConfig` (or a function
`make_config()` returning one); dotted overrides are applied on top of it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from titanrl.config import ConfigError, RunConfig, apply_overrides


def load_config_file(path: str) -> RunConfig:
    """Imports CONFIG.py (its folder goes on sys.path so it can import its neighbours)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    sys.path.insert(0, str(file.parent))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titanrl", description="PyTorch-native GRPO post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run GRPO from a config file")
    p_train.add_argument("config", help="Python file defining `config` (a titanrl.RunConfig)")
    p_train.add_argument("--out", help="run directory (same as --output.dir=...)")
    p_tiny = sub.add_parser("make-tiny", help="write a tiny random HF checkpoint with a byte tokenizer")
    p_tiny.add_argument("out_dir")
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "make-tiny":
            from titanrl.models.tiny import main as tiny_main

            tiny_main([args.out_dir, *rest])
            return 0
        config = load_config_file(args.config)
        overrides = list(rest) + ([f"output.dir={args.out}"] if args.out else [])
        config = apply_overrides(config, overrides)
        from titanrl.driver import train

        result = train(config)
    except ConfigError as e:
        print(f"titanrl: config error: {e}", file=sys.stderr)
        return 2
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
    summary += f"\nplot: {result.run_dir / 'progress.png'}"
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
