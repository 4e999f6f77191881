"""Continuous vs lock-step rollouts on the arithmetic example's workload, side by side in one script.

The same job (examples/arithmetic/config.py: its model, prompts, 64 prompts x 8 samples,
max_staleness=1, seed) runs twice, `--steps` steps each, alternating `--repeats` times:
  lockstep    rollout.continuous=false (the example's default);
  continuous  rollout.continuous=true.
Prints one JSON line per run and a summary line per pair:
  {"lockstep_step_s": ..., "continuous_step_s": ..., "step_ratio": ..., "gen_tok_s_ratio": ..., ...}
`step_s` is the loop's mean wall time per step (first step to last, no start-up, no evaluation);
`gen_tok_s` is generated tokens over that same wall time (the rate the run as a whole generated
at); `reported_gen_tok_s` is the mean of the runs' `throughput/gen_tokens_per_s` metric (lock-step:
the slowest worker's request time; continuous: time between two steps' rollouts being ready), so
the two modes' metric measures different spans. Ratios are continuous over lock-step (>= 1: continuous
is as fast). The CPU flags and the load average at start and end go in every line.

    python benchmarks/continuous_vs_lockstep.py [--steps 25] [--repeats 2]
    python benchmarks/continuous_vs_lockstep.py --smoke   # 2 steps of 8 prompts, 1 repeat: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import titanrl
from titanrl.cli import load_config_file
from titanrl.config import apply_overrides
from titanrl.kernels.cpu_build import isa_flags

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic" / "config.py"


def measure(root: Path, name: str, steps: int, continuous: bool, extra: list[str] = ()) -> dict[str, Any]:
    config = apply_overrides(load_config_file(str(EXAMPLE)), [
        f"train.steps={steps}", f"rollout.continuous={str(continuous).lower()}", "eval.every_steps=0",
        f"output.dir={root / name}", "output.progress_bar=false", "output.tensorboard=false", *extra,
    ])
    rows = [m for m in titanrl.train(config).metrics if m["step"] > 0]
    loop_s = rows[-1]["time/elapsed_s"] - (rows[0]["time/elapsed_s"] - rows[0]["time/step_s"])
    tokens = sum(m["throughput/gen_tokens_per_s"] * m["time/gen_s"] for m in rows)
    return {
        "run": name, "steps": len(rows), "loop_s": round(loop_s, 3), "step_s": round(loop_s / len(rows), 4),
        "gen_tokens": round(tokens), "gen_tok_s": round(tokens / loop_s, 1),
        "reported_gen_tok_s": round(sum(m["throughput/gen_tokens_per_s"] for m in rows) / len(rows), 1),
        "trainer_idle_s": round(sum(m.get("time/trainer_idle_s", m["time/wait_rollout_s"]) for m in rows), 3),
        "final_train_reward": round(sum(m["reward/mean"] for m in rows[-5:]) / len(rows[-5:]), 4),
        "staleness_max": max(m["staleness/max"] for m in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: --steps 2 --repeats 1, "
                        "8 prompts per step (numbers mean nothing)")
    args = parser.parse_args()
    extra = []
    if args.smoke:
        args.steps, args.repeats, extra = 2, 1, ["rollout.prompts_per_step=8"]
    flags = isa_flags()
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            load_start = os.getloadavg()[0]
            # Alternate which mode runs first, so a load change during the script hits both.
            order = [False, True] if repeat % 2 == 0 else [True, False]
            runs = {}
            for continuous in order:
                name = "continuous" if continuous else "lockstep"
                runs[name] = measure(Path(tmp), f"{name}{repeat}", args.steps, continuous, extra)
                print(json.dumps({**runs[name], "repeat": repeat}), flush=True)
            lock, cont = runs["lockstep"], runs["continuous"]
            print(json.dumps({
                "benchmark": "continuous_vs_lockstep", "smoke": args.smoke, "repeat": repeat, "steps": args.steps,
                "lockstep_step_s": lock["step_s"], "continuous_step_s": cont["step_s"],
                "step_ratio": round(lock["step_s"] / cont["step_s"], 3),
                "lockstep_gen_tok_s": lock["gen_tok_s"], "continuous_gen_tok_s": cont["gen_tok_s"],
                "gen_tok_s_ratio": round(cont["gen_tok_s"] / lock["gen_tok_s"], 3),
                "lockstep_reported_gen_tok_s": lock["reported_gen_tok_s"],
                "continuous_reported_gen_tok_s": cont["reported_gen_tok_s"],
                "loadavg_start": round(load_start, 2), "loadavg_end": round(os.getloadavg()[0], 2),
                "cpu_flags": flags,
            }), flush=True)


if __name__ == "__main__":
    main()
