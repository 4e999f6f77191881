"""LoRA against full fine-tuning, side by side: trainer memory, optimizer state, push bytes, push time, step time.

    .venv/bin/python benchmarks/lora.py [--models 25m,qwen3-0.6b] [--out benchmarks/results/lora/lora.jsonl]
    .venv/bin/python benchmarks/lora.py --smoke   # the tiny model, 1 step, 1 push, the 3 arms at once: checks it runs

Models: `25m`, the 25M-parameter `medium` Qwen3 of benchmarks/weight_sync.py (hidden 512, 8 layers),
and `qwen3-0.6b`, Qwen3-0.6B's shape (examples/configs/qwen3-0.6b.json, random init through
`python -m titanrl.models.tiny DIR --config-json ...`), float32. Arms, each in a fresh process one
after another (so a process's peak resident set is its arm's own):

  full          lora.rank=0: every weight trained, a push carries the whole model
  lora_adapter  lora.rank=8, lora.sync='adapter' (the default): a push carries the factors A and B
  lora_merged   lora.rank=8, lora.sync='merged': a push carries W + s * B @ A under the base names

Each arm builds a GRPOTrainer by hand (train.compute.threads=1, micro-batches of 4 sequences,
KL off), runs `--steps` GRPO steps on synthetic groups (`--groups` x `--group-size` samples, each a
shared prompt of `--prompt-tokens` plus ~`--completion-tokens` random tokens, generator logprobs
near the random model's own so the PPO ratio is ~1), then starts a real in-process vLLM engine
(VllmEngine, our model; VllmEngineConfig.lora = adapter_sync(...) for lora_adapter only, torch's
kernels) and pushes into it. One JSON line per arm and model:

  trainer_peak_gib        the process's peak resident set (getrusage) after the steps, before
                          anything of the push or vLLM: the trainer's own peak
  trainer_peak_push_gib   the same after one `state_dict_for_push()` more (the pushed copy is
                          the trainer's too: the full model's bytes for full and lora_merged)
  rss_loaded_gib          resident set right after the trainer was built (weights, before a step)
  weights_bytes           the model's parameters and buffers (LoRA: frozen base + factors; the merged
                          form builds each merged weight for its matmul and again in its backward)
  optimizer_state_bytes   every AdamW state tensor (exp_avg, exp_avg_sq, step) after the steps
  trainable_params        parameters with requires_grad
  step_s                  mean seconds of the `trainer.step` calls
  push_bytes              the tensors of `trainer.state_dict_for_push()`
  push_s                  median over `--pushes` (after one warm-up) of `state_dict_for_push()` plus
                          `engine.update_weights(pushed, version)`: what a push costs on one machine
                          with no transport (push_path says so); engine_load_s: the engine's own part
                          (engine.last_push_seconds), median

then one summary line per model with each LoRA arm over full (`ratios`: lora_adapter and
lora_merged) and the goals of issue 51 (push time <= 0.05x full, trainer peak <= 0.5x full) as
`goal_met` booleans. Compare the ratios; the absolute numbers depend on the CPU (`cpu`) and on what
else ran on it (`loadavg`). Reading them: a peak includes the process's own libraries (torch,
~0.45 GiB: most of the 25M model's peak); an adapter push lands in the engine's A and B (the
unmerged form: nothing to merge), a merged push is a full push; across machines the transfer,
which push_bytes measures, shrinks by the same ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEDIUM = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              intermediate_size=1536)
"""benchmarks/weight_sync.py's `medium` Qwen3 (~25M parameters), the issue's "25M model"."""
MODELS = ["25m", "qwen3-0.6b"]
ARMS = {"full": dict(rank=0), "lora_adapter": dict(rank=8, sync="adapter"), "lora_merged": dict(rank=8, sync="merged")}
GOALS = {"push_s": 0.05, "trainer_peak_gib": 0.5}
"""issue 51: a LoRA push at most 0.05x full fine-tuning's time, the trainer's peak at most 0.5x."""
WORKLOADS = {"25m": dict(groups=4, group_size=4, prompt_tokens=32, completion_tokens=64),
             "qwen3-0.6b": dict(groups=2, group_size=4, prompt_tokens=16, completion_tokens=48),
             "tiny": dict(groups=2, group_size=2, prompt_tokens=8, completion_tokens=8)}
"""Per model: GRPO groups x samples, prompt and mean completion tokens, sized so that 6 steps of
0.6B fit a few minutes of a shared 2-core CPU (the flags override them)."""
RATIO_KEYS = ["push_bytes", "push_s", "trainer_peak_gib", "trainer_peak_push_gib", "optimizer_state_bytes", "step_s"]


def synthetic_groups(groups: int, group_size: int, prompt_tokens: int, completion_tokens: int, vocab: int,
                     seed: int) -> list:
    """GRPO groups of random tokens: one prompt per group, completions of 0.75-1.25x
    `completion_tokens`, varied rewards (non-zero advantages), generator logprobs ~log(1/vocab)."""
    import torch

    from titanrl.types import Group, Sample

    g = torch.Generator().manual_seed(seed)
    ids = min(vocab, 32000)  # the byte tokenizer's ids and more; every id is a valid row of the head
    out = []
    for gid in range(groups):
        prompt = torch.randint(0, ids, (prompt_tokens,), generator=g).tolist()
        samples = []
        for r in torch.rand(group_size, generator=g).tolist():
            n = int(completion_tokens * (0.75 + 0.5 * float(torch.rand(1, generator=g))))
            logprobs = (-math.log(vocab) + 0.1 * torch.randn(n, generator=g)).tolist()
            samples.append(Sample("p", "c", prompt, torch.randint(0, ids, (n,), generator=g).tolist(), logprobs,
                                  r, gid, 0))
        out.append(Group(samples))
    return out


def run_arm(checkpoint: str, arm: str, a: argparse.Namespace) -> dict:
    """One arm in this process: train, measure the trainer, then push into a vLLM engine."""
    import gc

    import torch

    from titanrl.config import ComputeConfig, EngineConfig, LoraConfig, MemoryConfig, ModelConfig, TrainConfig
    from titanrl.memory import current_rss_bytes, peak_rss_bytes
    from titanrl.trainer.setup import TrainerSetup
    from titanrl.trainer.trainer import GRPOTrainer

    lora = LoraConfig(**ARMS[arm])
    train = TrainConfig(compute=ComputeConfig(threads=a.threads), memory=MemoryConfig(micro_batch_size=4))
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=checkpoint), train, 1.0, 0, lora=lora))
    rss_loaded = current_rss_bytes()
    seen: set[int] = set()
    weights = 0
    for t in [*trainer.model.parameters(), *trainer.model.buffers()]:
        if t.data_ptr() not in seen:  # tied embedding and head count once
            seen.add(t.data_ptr())
            weights += t.nbytes
    vocab = trainer.model.config.vocab_size
    step_s = []
    for i in range(a.steps):
        groups = synthetic_groups(a.groups, a.group_size, a.prompt_tokens, a.completion_tokens, vocab, seed=i)
        t0 = time.perf_counter()
        trainer.step(groups)
        step_s.append(time.perf_counter() - t0)
    trainer_peak = peak_rss_bytes()
    optimizer_state = sum(t.nbytes for s in trainer.optimizer.state.values() for t in s.values()
                          if torch.is_tensor(t))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    pushed = dict(trainer.state_dict_for_push().items())
    push_bytes = sum(t.nbytes for t in pushed.values())
    trainer_peak_push = peak_rss_bytes()
    del pushed
    # The pushes need the weights only: dropping the AdamW state leaves room for the engine (0.6B).
    trainer.optimizer.state.clear()
    gc.collect()

    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig, adapter_sync

    t0 = time.perf_counter()
    engine = VllmEngine(VllmEngineConfig(
        checkpoint=checkpoint, lora=adapter_sync(lora), warm_up=False,
        settings=EngineConfig(max_model_len=a.prompt_tokens + 2 * a.completion_tokens, max_num_seqs=4,
                              kv_cache_gib=0.25, vllm_kernels=False)))
    engine_start = time.perf_counter() - t0
    push_s, load_s = [], []
    try:
        for version in range(1, a.pushes + 2):  # the first is a warm-up
            t0 = time.perf_counter()
            engine.update_weights(dict(trainer.state_dict_for_push().items()), version)
            if version > 1 or a.pushes == 1:  # a single push (--smoke) is its own sample
                push_s.append(time.perf_counter() - t0)
                load_s.append(engine.last_push_seconds)
            if a.pushes == 1:
                break
    finally:
        engine.close()
    gib = 1 << 30
    return {
        "arm": arm, "lora_rank": lora.rank, "lora_sync": lora.sync if lora.rank else None,
        "trainer_peak_gib": round(trainer_peak / gib, 3), "trainer_peak_push_gib": round(trainer_peak_push / gib, 3),
        "rss_loaded_gib": round(rss_loaded / gib, 3), "weights_bytes": weights,
        "optimizer_state_bytes": optimizer_state, "trainable_params": trainable,
        "step_s": round(statistics.mean(step_s), 3), "steps": len(step_s),
        "push_bytes": push_bytes, "push_s": round(statistics.median(push_s), 5),
        "engine_load_s": round(statistics.median(load_s), 5), "pushes": len(push_s),
        "push_path": "in-process VllmEngine.update_weights (no transport)", "engine_start_s": round(engine_start, 1),
    }


def start_arm(checkpoint: str, arm: str, argv: list[str]) -> tuple[subprocess.Popen, float]:
    command = [sys.executable, __file__, "--arm", arm, "--checkpoint", checkpoint, *argv]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), \
        time.perf_counter()


def finish_arm(model: str, arm: str, started: tuple[subprocess.Popen, float]) -> dict:
    proc, start = started
    stdout, stderr = proc.communicate()
    head = {"model": model, "arm": arm}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**head, "error": f"exit {proc.returncode}", "stderr_tail": stderr[-3000:]}
    return {**head, **json.loads(lines[-1]), "wall_s": round(time.perf_counter() - start, 1)}


def make_checkpoint(model: str, work: Path, smoke: bool) -> str:
    from titanrl.models.tiny import write_tiny_checkpoint

    out = work / model
    if smoke:
        return str(write_tiny_checkpoint(out, seed=0))
    if model == "25m":
        return str(write_tiny_checkpoint(out, seed=0, **MEDIUM))
    subprocess.run([sys.executable, "-m", "titanrl.models.tiny", str(out), "--config-json",
                    str(ROOT / "examples" / "configs" / f"{model}.json")], check=True, capture_output=True)
    return str(out)


def summary(model: str, rows: list[dict], common: dict) -> dict:
    full = rows[0]
    ratios = {r["arm"]: {k: round(r[k] / full[k], 4) if full[k] else None for k in RATIO_KEYS} for r in rows[1:]}
    goal_met = {arm: {k: r[k] is not None and r[k] <= v for k, v in GOALS.items()} for arm, r in ratios.items()}
    return {"summary": True, "model": model, "ratios": ratios, "goals": GOALS, "goal_met": goal_met, **common}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=3, help="timed pushes per arm (after one warm-up)")
    for flag in ("--groups", "--group-size", "--prompt-tokens", "--completion-tokens"):
        parser.add_argument(flag, type=int, default=None, help="default: the model's WORKLOADS entry")
    parser.add_argument("--threads", type=int, default=1, help="train.compute.threads (1: no spinning OpenMP "
                        "threads to starve beside other work on the cores)")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 1 step, 1 push per arm: checks it runs")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # one arm, in this process
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    a = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.arm:
        print(json.dumps(run_arm(a.checkpoint, a.arm, a)), flush=True)
        return
    if a.smoke:
        if a.out:
            parser.error("--smoke keeps no results: drop --out")
        a.models, a.steps, a.pushes = "tiny", 1, 1

    from titanrl.kernels.cpu_build import cpu_model_name, isa_flags

    def workload(model: str) -> dict:
        given = {k: getattr(a, k) for k in WORKLOADS[model] if getattr(a, k) is not None}
        return {**WORKLOADS[model], **given, "steps": a.steps, "pushes": a.pushes, "threads": a.threads}

    common = {"cpu": cpu_model_name(), "cpu_flags": isa_flags(), "cpus": os.cpu_count(), "smoke": a.smoke}
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        for model in a.models.split(","):
            checkpoint = make_checkpoint(model, Path(tmp), a.smoke)
            work = workload(model)
            argv = [str(x) for k, v in work.items() for x in (f"--{k.replace('_', '-')}", v)]
            rows = []
            # --smoke starts the three arms at once (its numbers mean nothing; its time is mostly
            # start-up, which two cores halve); a real run measures them one after another.
            started = {arm: start_arm(checkpoint, arm, argv) for arm in ARMS} if a.smoke else {}
            for arm in ARMS:
                result = finish_arm(model, arm, started.get(arm) or start_arm(checkpoint, arm, argv))
                row = {**result, "workload": work, "cpu": common["cpu"], "cpu_flags": common["cpu_flags"],
                       "loadavg": [round(x, 2) for x in os.getloadavg()]}
                print(json.dumps(row), flush=True)
                rows.append(row)
            lines += rows
            if all("error" not in r for r in rows):
                lines.append(summary(model, rows, {**common, "workload": work}))
                print(json.dumps(lines[-1]), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write("".join(json.dumps(ln) + "\n" for ln in lines))
    sys.exit(1 if any("error" in ln for ln in lines) else 0)


if __name__ == "__main__":
    main()
