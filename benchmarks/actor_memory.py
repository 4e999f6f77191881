"""The memory plan against the measured peaks of a real run: trainer and rollout worker, side by side.

    .venv/bin/python benchmarks/actor_memory.py [--arms qwen3-0.6b,smollm2-135m] [--out benchmarks/results/actor_memory/actor_memory.jsonl]
    .venv/bin/python benchmarks/actor_memory.py --smoke   # the arithmetic example's tiny model, 1 step: checks it runs

Each arm makes a randomly initialised checkpoint of a published architecture
(`python -m titanrl.models.tiny DIR --config-json examples/configs/<arm>.json`) and runs

    titanrl train examples/arithmetic/config.py --model.checkpoint=DIR --rollout.prompts_per_step=4
        --rollout.group_size=4 --rollout.sampling.max_new_tokens=128 --rollout.engine.max_model_len=256
        --train.steps=2 --eval.every_steps=0

with every memory setting on `auto` (issue 52's run); `--lora-rank R` adds `--lora.rank=R` (a LoRA
run's plan: adapter-only gradients and AdamW state; the arm is named `<arm>+lora<R>`). It reads what the plan chose and estimated
from the run directory's config.resolved.json (`resolved.memory`) and the measured peaks from
metrics.jsonl (`memory/trainer_peak_gib`, `memory/worker_peak_gib`: each process's peak resident
set, getrusage, over the steps), and prints one JSON line per arm:

  chosen                 the settings `auto` resolved to
  trainer_estimate_gib   the plan's trainer peak (it includes the final export's copy of the
                         weights, which comes after the last step's metric: see trainer_note)
  trainer_measured_gib   the highest memory/trainer_peak_gib of the steps
  trainer_estimate_trained_gib: the same estimate for the sequences the steps really trained
                         (train/tokens / sequences per step, instead of max_model_len): the memory
                         model's own error, apart from the plan's bound on sequence length
  worker_estimate_gib, worker_measured_gib: the same for the rollout worker
  *_ratio                estimate / measured (goal: within 0.75-1.25)
  step_s                 seconds per step (mean of the two)
  wall_s                 the whole command, start-up included

The ratio compares the estimate with the measurement of the same run on the same machine; the
absolute numbers depend on the CPU and the vLLM build (say which).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "qwen3-0.6b": ROOT / "examples" / "configs" / "qwen3-0.6b.json",
    "smollm2-135m": ROOT / "examples" / "configs" / "smollm2-135m.json",
}
RUN_ARGS = ["--rollout.prompts_per_step=4", "--rollout.group_size=4", "--rollout.sampling.max_new_tokens=128",
            "--rollout.engine.max_model_len=256", "--train.steps=2", "--eval.every_steps=0"]
SMOKE_ARGS = ["--rollout.prompts_per_step=4", "--rollout.group_size=2", "--train.steps=1", "--eval.every_steps=0"]


def trained_estimate_gib(checkpoint: Path, args: list[str], chosen: dict, trained_tokens: float) -> float:
    """The plan's trainer peak at the chosen settings for sequences of the trained length."""
    from titanrl.cli import _load
    from titanrl.planning.fit import layout_of, trainer_workload
    from titanrl.planning.memory import estimate
    from titanrl.planning.shape import ModelShape

    overrides = [a.removeprefix("--") for a in args] + [f"model.checkpoint={checkpoint}"]
    config = _load(str(ROOT / "examples" / "arithmetic" / "config.py"), overrides)
    shape = ModelShape.from_config_json(checkpoint)
    work = trainer_workload(config, shape=shape)  # the trained length replaces the planned one below
    rows = work.batch
    work = dataclasses.replace(work, seq_len=max(1, math.ceil(trained_tokens / rows)),
                               micro_batch=chosen["train.memory.micro_batch_size"],
                               activation_checkpointing=chosen["train.memory.activation_checkpointing"])
    return estimate(shape, layout_of(config), work).peak / (1 << 30)


def run_arm(name: str, checkpoint: Path, args: list[str], work: Path) -> dict:
    out = work / f"run-{name}"
    command = [sys.executable, "-m", "titanrl.cli", "train", str(ROOT / "examples" / "arithmetic" / "config.py"),
               f"--model.checkpoint={checkpoint}", *args, "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"arm": name, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    resolved = json.loads((out / "config.resolved.json").read_text())["resolved"]
    memory = resolved["memory"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "memory/trainer_peak_gib" in s]
    gib = 1 << 30
    trainer_measured = max(s["memory/trainer_peak_gib"] for s in steps)
    worker_measured = max(s["memory/worker_peak_gib"] for s in steps)
    trainer_estimate = memory["trainer"]["peak"] / gib
    worker_estimate = memory["worker"]["peak"] / gib
    trained = trained_estimate_gib(checkpoint, args, memory["settings"], max(s["train/tokens"] for s in steps))
    return {
        "arm": name, "parameters": resolved["model"]["parameters"], "chosen": memory["settings"],
        "plan_total_gib": round(memory["total_bytes"] / gib, 2), "budget_gib": round(memory["budget_bytes"] / gib, 2),
        "trainer_estimate_gib": round(trainer_estimate, 2), "trainer_measured_gib": round(trainer_measured, 2),
        "trainer_ratio": round(trainer_estimate / trainer_measured, 3),
        "trainer_estimate_trained_gib": round(trained, 2), "trainer_trained_ratio": round(trained / trainer_measured, 3),
        "trained_tokens_per_step": max(s["train/tokens"] for s in steps),
        "trainer_export_copy_gib": round(memory["trainer"]["export_copy"] / gib, 2),
        "trainer_note": "the estimate's peak includes the final export's copy; the measured steps end before it",
        "worker_estimate_gib": round(worker_estimate, 2), "worker_measured_gib": round(worker_measured, 2),
        "worker_ratio": round(worker_estimate / worker_measured, 3),
        "step_s": round(sum(s["time/step_s"] for s in steps) / len(steps), 1), "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated: " + ", ".join(ARMS))
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true", help="the example's tiny model, 1 step: checks it runs")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)")
    a = parser.parse_args()
    lora_args = [f"--lora.rank={a.lora_rank}"] if a.lora_rank > 0 else []
    suffix = f"+lora{a.lora_rank}" if a.lora_rank > 0 else ""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    records = []
    with tempfile.TemporaryDirectory(prefix="actor-memory-") as tmp:
        work = Path(tmp)
        if a.smoke:
            records.append(run_arm("smoke" + suffix, ROOT / "examples" / "arithmetic" / "warm_start",
                                   SMOKE_ARGS + lora_args, work))
        else:
            for name in a.arms.split(","):
                checkpoint = work / name
                subprocess.run([sys.executable, "-m", "titanrl.models.tiny", str(checkpoint), "--config-json",
                                str(ARMS[name])], check=True, capture_output=True)
                records.append(run_arm(name + suffix, checkpoint, RUN_ARGS + lora_args, work))
    from titanrl.kernels.cpu_build import cpu_model_name

    ok = [r for r in records if "error" not in r]
    summary = {"summary": True, "cpu": cpu_model_name(), "arms": len(records), "failed": len(records) - len(ok),
               "trainer_ratios": {r["arm"]: r["trainer_ratio"] for r in ok},
               "trainer_trained_ratios": {r["arm"]: r["trainer_trained_ratio"] for r in ok},
               "worker_ratios": {r["arm"]: r["worker_ratio"] for r in ok}}
    lines = [json.dumps(r) for r in records + [summary]]
    print("\n".join(lines))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(1 if len(ok) < len(records) else 0)


if __name__ == "__main__":
    main()
