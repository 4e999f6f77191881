"""TitanRL's GRPO step time against TRL's `GRPOTrainer` on the same machine, model, prompts and reward.

Issue 21's workload: a ~19M-parameter Qwen3 (`--size 19m`: hidden 512, 6 layers, 8 heads of 64,
4 KV heads, MLP 1536, the 259-token byte vocabulary; written with
`titanrl.models.tiny.write_tiny_checkpoint(seed=0)`, its parameter count is printed), the
prompts of examples/arithmetic/data/train.jsonl and the reward of examples/arithmetic/task.py,
8 prompts x 8 samples per step, completions of up to 64 new tokens at temperature 1, float32,
lr 1e-3, no KL term. The two arms:
  titanrl  examples/arithmetic/config.py with overrides (rollout.prompts_per_step=8,
           rollout.sampling.max_new_tokens=64, rollout.engine.max_model_len=128, train.max_staleness=1,
           train.compute.threads=--threads, eval off, plus --titanrl-overrides), run by
           `titanrl.train(config)`: vLLM rollouts overlapped with training, one step behind;
           its rollout worker keeps rollout.engine.threads (1 unless overridden).
  trl      TRL's GRPOTrainer with HF generate (no vLLM): per_device_train_batch_size=64,
           num_generations=8, max_completion_length=64, one optimizer step per generation
           batch, torch.set_num_threads(--threads), in .venv-trl (`make trl-venv`).
Each arm runs in its own process (so Ray, TRL and their threads are gone before the other
starts), TitanRL's under this interpreter, TRL's under .venv-trl's
(`python benchmarks/vs_trl.py --arm trl ...`). They alternate, titanrl then trl, `--repeats`
times, so a load change hits both.

Neither side ignores EOS (TitanRL has no such setting, so TRL gets none either): both sample
from the same random-init policy, which puts about 1/259 of its mass on EOS at every token, so
~80 % of completions run to 64 tokens and the mean lengths come out alike (57-58 tokens in
both arms in a smoke run); each arm's is reported, and tokens_per_s corrects for what is left.
The policy never solves a sum, so every advantage is 0 on both sides: the loss and its
backward are still computed in full by both.

Per arm (one JSON line per run): step_s, the median seconds per optimizer step over the steps
after the first (warm-up), with every step's time in step_times_s; TitanRL's from metrics rows'
`time/step_s` (rollout wait + train step, the loop's wall time per step), TRL's from a
TrainerCallback timing on_step_begin -> on_step_end (generation, scoring, forward, backward,
optimizer). tokens_per_s: generated tokens per step / step_s. completion_len_mean over the
measured steps (TitanRL's `completion/len_mean`, TRL's `completions/mean_length`).
torch_threads; TitanRL also the medians of `time/train_s` (trainer step) and `time/gen_s`
(rollout batch). The last line is the summary: the medians over repeats and
ratio_titanrl_over_trl_speed = TRL step_s / TitanRL step_s (> 1: TitanRL is faster; issue 21
asks for >= 1.5). Every line carries the CPU flags and the load average.

    make trl-venv                                   # once: .venv-trl with TRL
    .venv/bin/python benchmarks/vs_trl.py [--steps 10] [--repeats 2] [--threads 2] \\
        [--size 19m|small] [--titanrl-overrides train.compute.share_prompts=false ...] [--out FILE.jsonl]

    .venv/bin/python benchmarks/vs_trl.py --steps 3 --repeats 1 --size small   # a quick check
    .venv/bin/python benchmarks/vs_trl.py --smoke    # small and short (see --help); TRL's arm if .venv-trl exists

`--workload reasoning` (issue 47): the real model on the real task. SmolLM2-135M-Instruct
converted by `titanrl models get smollm2-135m-instruct` (cached), the chain_sum rows of
examples/reasoning/task.py rendered with the checkpoint's chat template (TRL gets the same rows
as conversational prompts), the rewards reasoning_gym_answer + 0.1 x reasoning_gym_format,
16 prompts x 8 samples per step, up to 64 new tokens at temperature 1.0, lr 3e-5 with 2 warm-up
steps then constant, no KL, `--steps` steps (default 20). TitanRL runs examples/reasoning/config.py
as written (eval off during the run); TRL's GRPOTrainer gets micro-batches of 16 with 8 accumulation
steps, so one optimizer step consumes one generation batch of 128 completions, as TitanRL's.
After the arms, one evaluator scores the base checkpoint and each arm's final weights alike:
`titanrl eval` (vLLM, greedy) on the example's 200 held-out questions. The summary adds each
arm's held-out accuracy before and after and ratio_titanrl_over_trl_speed (issue 47 asks >= 2,
with a gain at least TRL's).

    .venv/bin/python benchmarks/vs_trl.py --workload reasoning --steps 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = ROOT / "examples" / "arithmetic"
EXAMPLE_CONFIG = EXAMPLE_DIR / "config.py"
TRAIN_FILE = EXAMPLE_DIR / "data" / "train.jsonl"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"

SIZES = {
    "19m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                head_dim=64, intermediate_size=1536),
    "small": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=384),
}
"""`--size`: issue 21's 19M Qwen3 (as benchmarks/trainer_step.py's `19m`), or a 0.4M one for smoke runs."""
PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
MAX_NEW_TOKENS = 64
MAX_MODEL_LEN = 128
"""Longest prompt + completion TitanRL's engine accepts (the prompts are <= 8 bytes)."""
LR = 1e-3
"""The example's learning rate, for both arms (it does not change the work of a step)."""
WARMUP_STEPS = 1
"""Steps left out of step_s: start-up costs (first forward, allocations, TitanRL's unoverlapped first rollout)."""
ISSUE_TARGET = 1.5
"""Issue 21's goal for ratio_titanrl_over_trl_speed."""

REASONING_DIR = ROOT / "examples" / "reasoning"
REASONING_CONFIG = REASONING_DIR / "config.py"
REASONING = dict(prompts_per_step=16, group_size=8, max_new_tokens=64, lr=3e-5, warmup_steps=2,
                 micro_batch_size=16, temperature=1.0, reward_weights=[1.0, 0.1], target=2.0)
"""`--workload reasoning`: examples/reasoning/config.py's recipe (checked against it by
`check_reasoning_recipe`), what TRL's arm is given, and issue 47's speed goal."""


# --- pure helpers -----------------------------------------------------------------------------

def median_after_warmup(values: list[float], warmup: int = WARMUP_STEPS) -> float:
    """The median of `values` without the first `warmup`; refuses when none would be left."""
    measured = values[warmup:]
    if not measured:
        raise ValueError(f"{len(values)} step(s) leave none after {warmup} warm-up step(s): raise --steps")
    return statistics.median(measured)


def tokens_per_s(completion_len_mean: float, samples_per_step: int, step_s: float) -> float:
    """Generated tokens per second of a run whose steps each generate `samples_per_step` completions."""
    return completion_len_mean * samples_per_step / step_s


def titanrl_step_stats(rows: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """step_s, train_s, gen_s and completion length of TitanRL metrics rows (the eval row of step 0
    and rows of other kinds are skipped); train_s / gen_s only where the rows have them."""
    steps = sorted((r for r in rows if r.get("step", 0) > 0 and "time/step_s" in r), key=lambda r: r["step"])
    step_s = median_after_warmup([r["time/step_s"] for r in steps], warmup)
    measured = steps[warmup:]
    stats: dict[str, Any] = {
        "step_s": step_s,
        "step_times_s": [round(r["time/step_s"], 4) for r in steps],
        "measured_steps": len(measured),
        "completion_len_mean": statistics.fmean(r["completion/len_mean"] for r in measured),
    }
    for key in ("time/train_s", "time/gen_s"):
        if all(key in r for r in steps):
            stats[key.split("/")[1]] = median_after_warmup([r[key] for r in steps], warmup)
    return stats


def trl_step_stats(step_times: list[float], lengths: list[float], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """step_s and completion length from TRL's per-step timings and logged mean completion lengths."""
    measured_lengths = lengths[warmup:] or lengths
    return {
        "step_s": median_after_warmup(step_times, warmup),
        "step_times_s": [round(t, 4) for t in step_times],
        "measured_steps": len(step_times[warmup:]),
        "completion_len_mean": statistics.fmean(measured_lengths) if measured_lengths else None,
    }


def summarize(results: list[dict[str, Any]], target: float = ISSUE_TARGET,
              samples_per_step: int = PROMPTS_PER_STEP * GROUP_SIZE) -> dict[str, Any]:
    """The summary over repeats: each arm's median step_s and tokens_per_s, and TRL over TitanRL.

    ratio_titanrl_over_trl_speed is TRL's median step_s over TitanRL's (> 1: TitanRL is faster);
    per_repeat_ratios pairs the two arms' runs of each repeat."""
    by_arm = {arm: [r for r in results if r["arm"] == arm] for arm in ("titanrl", "trl")}
    if not by_arm["titanrl"] or not by_arm["trl"]:
        raise ValueError("the summary needs at least one titanrl and one trl run")
    med = {arm: {key: statistics.median(r[key] for r in runs) for key in ("step_s", "tokens_per_s")}
           for arm, runs in by_arm.items()}
    trl_by_repeat = {r["repeat"]: r for r in by_arm["trl"]}
    per_repeat = [round(trl_by_repeat[r["repeat"]]["step_s"] / r["step_s"], 3)
                  for r in by_arm["titanrl"] if r["repeat"] in trl_by_repeat]
    ratio = med["trl"]["step_s"] / med["titanrl"]["step_s"]
    return {
        "titanrl_step_s": round(med["titanrl"]["step_s"], 4),
        "trl_step_s": round(med["trl"]["step_s"], 4),
        "ratio_titanrl_over_trl_speed": round(ratio, 3),
        "per_repeat_ratios": per_repeat,
        "titanrl_tokens_per_s": round(med["titanrl"]["tokens_per_s"], 1),
        "trl_tokens_per_s": round(med["trl"]["tokens_per_s"], 1),
        "ratio_tokens_per_s": round(med["titanrl"]["tokens_per_s"] / med["trl"]["tokens_per_s"], 3),
        "titanrl_completion_len_mean": round(statistics.fmean(r["completion_len_mean"] for r in by_arm["titanrl"]), 2),
        "trl_completion_len_mean": round(statistics.fmean(r["completion_len_mean"] for r in by_arm["trl"]), 2),
        "issue_target": target,
        "meets_issue_target": ratio >= target,
        "samples_per_step": samples_per_step,
    }


def titanrl_overrides(checkpoint: str, steps: int, threads: int, out_dir: str, extra: list[str]) -> list[str]:
    """The example config's overrides for this workload; `extra` (--titanrl-overrides) come last and win."""
    return [
        f"model.checkpoint={checkpoint}",
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.group_size={GROUP_SIZE}",
        f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}", f"rollout.engine.max_model_len={MAX_MODEL_LEN}",
        f"train.optimizer.lr={LR}", "train.max_staleness=1", f"train.steps={steps}", f"train.compute.threads={threads}",
        "eval.every_steps=0", f"output.dir={out_dir}", "output.progress_bar=false", "output.tensorboard=false",
        *extra,
    ]


def machine_fields() -> dict[str, Any]:
    """What goes in every line: the CPU flags and the 1-minute load average now."""
    from titanrl.kernels.cpu_build import isa_flags

    return {"cpu_flags": isa_flags(), "loadavg": round(os.getloadavg()[0], 2)}


def rounded(stats: dict[str, Any]) -> dict[str, Any]:
    """Floats to 4 decimals for printing (lists and other values untouched)."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}


# --- the arms (each in its own process) -----------------------------------------------------

def run_titanrl_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the TitanRL arm once (this interpreter must be the main .venv's) and returns its stats."""
    import titanrl
    from titanrl.cli import load_config_file
    from titanrl.config import apply_overrides

    out_dir = Path(args.work_dir) / "titanrl-run"
    config = apply_overrides(load_config_file(str(EXAMPLE_CONFIG)), titanrl_overrides(
        args.checkpoint, args.steps, args.threads, str(out_dir), args.titanrl_overrides))
    stats = titanrl_step_stats(titanrl.train(config).metrics)
    stats["torch_threads"] = {"trainer": config.train.compute.threads,
                              "rollout_worker": config.rollout.engine.threads,
                              "rollout_workers": config.rollout.num_workers}
    stats["overrides"] = args.titanrl_overrides
    return stats


def arithmetic_rows() -> list[dict[str, str]]:
    """The example's training rows ({"prompt", "answer"})."""
    return [json.loads(line) for line in TRAIN_FILE.read_text().splitlines() if line.strip()]


def arithmetic_reward():
    """examples/arithmetic/task.py's `reward(prompt, completion, answer)`."""
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    from task import reward

    return reward


def trl_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """The example's reward in TRL's batched form (one score per completion)."""
    reward = arithmetic_reward()
    return [reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]


def step_timer() -> Any:
    """A TRL TrainerCallback timing each optimizer step (begin -> end) and logging mean completion lengths."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Seconds from each optimizer step's begin to its end, and each logged mean completion length."""

        def __init__(self) -> None:
            self.begin, self.times, self.lengths = 0.0, [], []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.times.append(time.perf_counter() - self.begin)

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))

    return StepTimer()


def run_trl_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the TRL arm once (this interpreter must be .venv-trl's) and returns its stats."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    config = GRPOConfig(
        output_dir=str(Path(args.work_dir) / "trl-run"), max_steps=args.steps, learning_rate=LR,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, max_completion_length=MAX_NEW_TOKENS, temperature=1.0, beta=0.0,
        use_vllm=False, use_cpu=True, bf16=False, fp16=False, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    timer = step_timer()
    trainer = GRPOTrainer(
        model=args.checkpoint, reward_funcs=[trl_reward], args=config,
        train_dataset=Dataset.from_list(arithmetic_rows()),
        processing_class=AutoTokenizer.from_pretrained(args.checkpoint), callbacks=[timer],
    )
    trainer.train()
    stats = trl_step_stats(timer.times, timer.lengths)
    stats["torch_threads"] = torch.get_num_threads()
    stats["dtype"] = str(next(trainer.model.parameters()).dtype)
    stats["versions"] = {"torch": torch.__version__, "trl": _version("trl"), "transformers": _version("transformers")}
    return stats


def reasoning_task() -> Any:
    """examples/reasoning/task.py (its folder goes on sys.path, as `titanrl train` does for config.py)."""
    if str(REASONING_DIR) not in sys.path:
        sys.path.insert(0, str(REASONING_DIR))
    import task

    return task


def check_reasoning_recipe(config: Any) -> None:
    """Refuses to run when examples/reasoning/config.py no longer matches REASONING (what TRL gets)."""
    from titanrl.config.unplanned import concrete_memory

    found = dict(
        prompts_per_step=config.rollout.prompts_per_step,
        group_size=config.rollout.group_size,
        max_new_tokens=config.rollout.sampling.max_new_tokens,
        lr=config.train.optimizer.lr,
        warmup_steps=config.train.lr_schedule.warmup_steps,
        micro_batch_size=concrete_memory(config.train.memory).micro_batch_size,
        temperature=config.rollout.sampling.temperature,
        reward_weights=list(config.reward_weights),
    )
    differ = {k: (v, REASONING[k]) for k, v in found.items() if v != REASONING[k]}
    if differ:
        raise SystemExit(f"examples/reasoning/config.py differs from vs_trl's REASONING (config, here): {differ}; "
                         "update REASONING so that both arms do the same work")


def run_titanrl_reasoning_arm(args: argparse.Namespace) -> dict[str, Any]:
    """examples/reasoning/config.py as written, on --checkpoint, for --steps steps, eval off;
    its final weights go to WORK_DIR/final (an HF checkpoint) for the evaluator."""
    import titanrl
    from titanrl.cli import load_config_file
    from titanrl.config import apply_overrides

    out_dir = Path(args.work_dir) / "titanrl-run"
    config = apply_overrides(load_config_file(str(REASONING_CONFIG)), [
        f"model.checkpoint={args.checkpoint}", f"train.steps={args.steps}", "eval.every_steps=0",
        f"output.dir={out_dir}", "output.progress_bar=false", "output.tensorboard=false", *args.titanrl_overrides])
    check_reasoning_recipe(config)
    stats = titanrl_step_stats(titanrl.train(config).metrics)
    stats["final"] = str(out_dir)  # `titanrl eval` takes a run directory (its newest policy)
    stats["torch_threads"] = {"trainer": config.train.compute.threads, "trainer_when_rollouts_idle":
                              config.train.compute.threads_when_rollouts_idle,
                              "rollout_worker": config.rollout.engine.threads}
    stats["overrides"] = args.titanrl_overrides
    return stats


def completion_text(completion: Any) -> str:
    """TRL hands conversational completions as a list of messages; plain ones as a string."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if m.get("role") == "assistant")


def trl_reasoning_rewards() -> list[Any]:
    """reasoning_gym_answer and reasoning_gym_format in TRL's batched form (the same functions)."""
    from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format

    def batched(fn: Any) -> Any:
        def reward(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float]:
            # Row columns come as lists, one value per completion; TRL adds non-list extras (trainer_state).
            columns = {k: v for k, v in columns.items() if isinstance(v, list) and k not in ("prompt", "messages")}
            fields = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]
            return [fn("", completion_text(c), **f) for c, f in zip(completions, fields, strict=True)]

        reward.__name__ = fn.__name__
        return reward

    return [batched(reasoning_gym_answer), batched(reasoning_gym_format)]


def run_trl_reasoning_arm(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same rows, rewards and recipe; final weights to WORK_DIR/final."""
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    rows = reasoning_task().chain_sum_data().train_rows.rename_column("messages", "prompt")
    r = REASONING
    config = GRPOConfig(
        output_dir=str(Path(args.work_dir) / "trl-run"), max_steps=args.steps, learning_rate=r["lr"],
        warmup_steps=r["warmup_steps"], lr_scheduler_type="constant_with_warmup",
        per_device_train_batch_size=r["micro_batch_size"],
        gradient_accumulation_steps=r["prompts_per_step"] * r["group_size"] // r["micro_batch_size"],
        num_generations=r["group_size"], max_completion_length=r["max_new_tokens"], temperature=r["temperature"],
        reward_weights=r["reward_weights"], beta=0.0, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    timer = step_timer()
    trainer = GRPOTrainer(model=args.checkpoint, reward_funcs=trl_reasoning_rewards(), args=config,
                          train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(args.checkpoint),
                          callbacks=[timer])
    trainer.train()
    final = Path(args.work_dir) / "final"
    trainer.save_model(str(final))
    stats = trl_step_stats(timer.times, timer.lengths)
    stats["final"] = str(final)
    stats["torch_threads"] = torch.get_num_threads()
    stats["dtype"] = str(next(trainer.model.parameters()).dtype)
    stats["loss_type"] = config.loss_type
    stats["versions"] = {"torch": torch.__version__, "trl": _version("trl"), "transformers": _version("transformers")}
    return stats


def run_eval_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Held-out greedy accuracy of --checkpoint (an HF folder or a run directory) under the reasoning
    example's config: what `titanrl eval CHECKPOINT --config examples/reasoning/config.py` prints."""
    from titanrl.cli import load_config_file
    from titanrl.commands.evaluate import evaluate_checkpoint

    started = time.perf_counter()
    report = evaluate_checkpoint(load_config_file(str(REASONING_CONFIG)), args.checkpoint)
    return {"accuracy": report.accuracy, "reward_mean": report.reward_mean, "prompts": report.prompts,
            "eval_s": round(time.perf_counter() - started, 1)}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# --- the driver -------------------------------------------------------------------------------

def write_checkpoint(directory: Path, size: str) -> int:
    """Writes the `size` model's random-init checkpoint (seed 0); returns its parameter count."""
    import torch

    from titanrl.models.architectures import build_model
    from titanrl.models.tiny import tiny_config, write_tiny_checkpoint

    write_tiny_checkpoint(directory, seed=0, **SIZES[size])
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(tiny_config(**SIZES[size])).parameters())


def child_env(threads: int) -> dict[str, str]:
    """The arm process's environment: `threads` intra-op threads, offline, no tokenizer threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_arm(arm: str, python: str, args: argparse.Namespace, checkpoint: Path, work_dir: Path) -> dict[str, Any]:
    """Runs one arm in a fresh process of `python`; its output goes to stderr, its stats come back by file."""
    work_dir.mkdir(parents=True)
    result = work_dir / "result.json"
    cmd = [python, str(Path(__file__).resolve()), "--arm", arm, "--checkpoint", str(checkpoint),
           "--workload", args.workload,
           "--work-dir", str(work_dir), "--result", str(result), "--steps", str(args.steps),
           "--threads", str(args.threads), *(["--smoke"] if args.smoke else []),
           "--titanrl-overrides", *args.titanrl_overrides]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(args.threads), stdout=sys.stderr, cwd=ROOT)
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"the {arm} arm failed (exit {proc.returncode}); its output is above")
    stats = json.loads(result.read_text())
    stats["process_s"] = round(time.perf_counter() - started, 1)
    return stats


def emit(record: dict[str, Any], out: Path | None) -> None:
    """Prints one JSON line (and appends it to --out)."""
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def drive_reasoning(args: argparse.Namespace, out: Path | None, pythons: dict[str, str]) -> None:
    """`--workload reasoning`: the arms on SmolLM2 (cached by `titanrl models get`), then one evaluator
    on the base checkpoint and each arm's final weights; prints each run and the summary."""
    from titanrl.commands.models import get_model

    checkpoint = get_model(reasoning_task().MODEL)
    r = REASONING
    samples = r["prompts_per_step"] * r["group_size"]
    base = {"benchmark": "vs_trl", "workload": "reasoning", "model": reasoning_task().MODEL, "steps": args.steps,
            "threads": args.threads, **{k: r[k] for k in ("prompts_per_step", "group_size", "max_new_tokens",
                                                         "temperature", "lr")}}
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        before = run_arm("eval", sys.executable, args, checkpoint, Path(tmp) / "eval-base")
        emit({**base, "eval": "base", **before, **machine_fields()}, out)
        results = []
        for repeat in range(args.repeats):
            for arm in args.arms:
                load_start = round(os.getloadavg()[0], 2)
                stats = run_arm(arm, pythons[arm], args, checkpoint, Path(tmp) / f"{arm}{repeat}")
                stats["tokens_per_s"] = tokens_per_s(stats["completion_len_mean"], samples, stats["step_s"])
                after = run_arm("eval", sys.executable, args, Path(stats.pop("final")), Path(tmp) / f"eval-{arm}{repeat}")
                stats.update(accuracy_before=before["accuracy"], accuracy_after=after["accuracy"],
                             accuracy_gain=after["accuracy"] - before["accuracy"],
                             reward_mean_after=after["reward_mean"], eval_prompts=after["prompts"])
                record = {**base, "arm": arm, "repeat": repeat, **rounded(stats), "loadavg_start": load_start,
                          **machine_fields()}
                results.append(record)
                emit(record, out)
        if set(args.arms) == {"titanrl", "trl"}:
            summary = summarize(results, r["target"], samples)
            gains = {arm: statistics.median(x["accuracy_gain"] for x in results if x["arm"] == arm)
                     for arm in ("titanrl", "trl")}
            summary.update(accuracy_before=round(before["accuracy"], 4),
                           titanrl_accuracy_gain=round(gains["titanrl"], 4), trl_accuracy_gain=round(gains["trl"], 4),
                           meets_gain_target=gains["titanrl"] >= gains["trl"])
            emit({**base, "summary": True, "repeats": args.repeats, **summary, **machine_fields()}, out)


def drive(args: argparse.Namespace) -> None:
    """Writes the checkpoint, alternates the arms `--repeats` times, prints each run and the summary."""
    trl_python = Path(args.trl_python)
    if args.smoke and "trl" in args.arms and not trl_python.is_file():  # a smoke run checks what it can
        args.arms = [arm for arm in args.arms if arm != "trl"]
        emit({"benchmark": "vs_trl", "smoke": True,
              "trl_arm": f"not run: {trl_python} does not exist (`make trl-venv` builds it)"}, None)
    if "trl" in args.arms and not trl_python.is_file():
        raise SystemExit(f"{trl_python} does not exist: run `make trl-venv` first")
    out = Path(args.out) if args.out else None
    if args.workload == "reasoning":
        drive_reasoning(args, out, {"titanrl": sys.executable, "trl": str(trl_python)})
        return
    base = {"benchmark": "vs_trl", "smoke": args.smoke, "size": args.size, "steps": args.steps, "threads": args.threads,
            "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE, "max_new_tokens": MAX_NEW_TOKENS}
    pythons = {"titanrl": sys.executable, "trl": str(trl_python)}
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        params = write_checkpoint(checkpoint, args.size)
        print(f"vs_trl: {args.size} Qwen3, {params / 1e6:.2f}M parameters, checkpoint {checkpoint}", file=sys.stderr)
        base["model_params"] = params
        results = []
        for repeat in range(args.repeats):
            for arm in args.arms:
                load_start = round(os.getloadavg()[0], 2)
                stats = run_arm(arm, pythons[arm], args, checkpoint, Path(tmp) / f"{arm}{repeat}")
                stats["tokens_per_s"] = tokens_per_s(stats["completion_len_mean"], PROMPTS_PER_STEP * GROUP_SIZE,
                                                     stats["step_s"])
                record = {**base, "arm": arm, "repeat": repeat, **rounded(stats), "loadavg_start": load_start,
                          **machine_fields()}
                results.append(record)
                emit(record, out)
        if set(args.arms) == {"titanrl", "trl"}:
            emit({**base, "summary": True, "repeats": args.repeats,
                  **summarize(results, samples_per_step=PROMPTS_PER_STEP * GROUP_SIZE), **machine_fields()}, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["arithmetic", "reasoning"], default="arithmetic",
                        help="issue 21's tiny random Qwen3 on arithmetic, or issue 47's SmolLM2 on chain_sum")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run, the first is warm-up (default 10; 20 for reasoning)")
    parser.add_argument("--repeats", type=int, default=2, help="times each arm runs, alternating")
    parser.add_argument("--threads", type=int, default=2,
                        help="TRL's torch threads; TitanRL's train.compute.threads (its rollout worker keeps "
                             "rollout.engine.threads, 1 unless overridden)")
    parser.add_argument("--size", choices=sorted(SIZES), default="19m")
    parser.add_argument("--titanrl-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra TitanRL config overrides, e.g. train.compute.share_prompts=false")
    parser.add_argument("--out", default="", help="also append every JSON line to this file")
    parser.add_argument("--arms", nargs="+", choices=["titanrl", "trl"], default=["titanrl", "trl"],
                        help="which arms to run, in this order each repeat")
    parser.add_argument("--trl-python", default=str(TRL_PYTHON), help="the interpreter of TRL's venv")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: the arithmetic workload "
                        "with --size small --steps 2 --repeats 1, 4 prompts x 8 samples of up to 16 tokens; TRL's arm "
                        "only where --trl-python exists (numbers mean nothing)")
    # One arm in this process (what the driver starts): --arm, --checkpoint, --work-dir, --result.
    parser.add_argument("--arm", choices=["titanrl", "trl", "eval"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # the driver and the arms it starts (which get --smoke too)
        if args.out or args.workload != "arithmetic":
            parser.error("--smoke runs the arithmetic workload and keeps no results: drop --out and --workload")
        global PROMPTS_PER_STEP, MAX_NEW_TOKENS
        PROMPTS_PER_STEP, MAX_NEW_TOKENS = 4, 16
        args.size, args.steps, args.repeats = "small", 2, 1
    if args.steps is None:
        args.steps = 20 if args.workload == "reasoning" else 10
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS} (the warm-up step is not measured)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.arm is None:
        drive(args)
        return
    if not args.checkpoint:
        raise SystemExit("--arm needs --checkpoint (a directory written by write_tiny_checkpoint)")
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix=f"vs_trl-{args.arm}-")
    arms = {("titanrl", "arithmetic"): run_titanrl_arm, ("trl", "arithmetic"): run_trl_arm,
            ("titanrl", "reasoning"): run_titanrl_reasoning_arm, ("trl", "reasoning"): run_trl_reasoning_arm}
    stats = run_eval_arm(args) if args.arm == "eval" else arms[args.arm, args.workload](args)
    if args.result:
        Path(args.result).write_text(json.dumps(stats))
    else:
        print(json.dumps(stats))


if __name__ == "__main__":
    main()
