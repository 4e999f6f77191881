"""The engine on a thread of its own: what one malloc arena for every thread saves, in one script.

A continuous rollout worker steps vLLM on a thread of its own (`AsyncGenerator`), not on the
actor's main thread. glibc gives each new thread a malloc arena of its own, whose heaps it trims
and maps again as tensors come and go, so that thread pays page faults the main thread does not.
TitanRL's Ray actors run with one arena (`MALLOC_ARENA_MAX=1`, `titanrl.driver.ray_runtime`).

This generates the arithmetic example's batch (64 prompts x 8 samples, lock-step
`RolloutWorker.generate`) alternately on the main thread and on a helper thread, in one process
per arena setting (glibc reads it at start):
  default_arenas   MALLOC_ARENA_MAX unset (glibc's default: 8 per core);
  one_arena        MALLOC_ARENA_MAX=1 (what TitanRL's actors get).
Prints one JSON line per setting and a summary:
  {"setting": ..., "main_cpu_s": ..., "thread_cpu_s": ..., "thread_over_main": ..., "main_faults": ..., "thread_faults": ...}
CPU seconds and minor page faults are the generating thread's own, per batch (median over
`--batches`); `thread_over_main` is thread CPU over main-thread CPU (1.0: the thread costs nothing).

    python benchmarks/engine_thread.py [--batches 30]
    python benchmarks/engine_thread.py --smoke    # one_arena only, 8 prompts, 1 batch per thread: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic"


def measure(batches: int, prompts: int | None = None) -> dict[str, float]:
    """(In the child process.) Generates `batches` batches on each thread, alternating (of `prompts`
    prompts: default the example's rollout.prompts_per_step)."""
    import resource
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from titanrl.cli import load_config_file
    from titanrl.config.resolve import resolve
    from titanrl.jsonl import read_json_lines
    from titanrl.rollout.vllm.engine import use_intra_op_threads
    from titanrl.rollout.worker import RolloutWorker

    sys.path.insert(0, str(EXAMPLE))  # the config imports its task module
    cfg = load_config_file(str(EXAMPLE / "config.py"))
    rows = read_json_lines(EXAMPLE / "data" / "train.jsonl").values()
    worker = RolloutWorker(0, resolve(cfg))
    size = prompts or cfg.rollout.prompts_per_step
    helper = ThreadPoolExecutor(1, initializer=use_intra_op_threads, initargs=(torch.get_num_threads(),))

    def batch(b: int) -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        cpu = time.thread_time()
        worker.generate([rows[(b * size + j) % len(rows)] for j in range(size)], 1000 + b * 512, b * size)
        return time.thread_time() - cpu, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults

    batch(0)  # warm-up on both threads
    helper.submit(batch, 0).result()
    main, thread = [], []
    for b in range(1, batches + 1):
        main.append(batch(b))
        thread.append(helper.submit(batch, b).result())
    return {
        "main_cpu_s": round(statistics.median(c for c, _ in main), 4),
        "thread_cpu_s": round(statistics.median(c for c, _ in thread), 4),
        "main_faults": statistics.median(f for _, f in main),
        "thread_faults": statistics.median(f for _, f in thread),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: batches of 8 prompts, "
                        "--batches 1, the one_arena setting only (each setting starts an engine in a process of its "
                        "own); numbers mean nothing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.batches = 1
    if args.child:
        print("RESULT " + json.dumps(measure(args.batches, 8 if args.smoke else None)), flush=True)
        os._exit(0)  # (vLLM's engine shutdown adds nothing here)
    rows = {}
    settings = (("default_arenas", None), ("one_arena", "1"))
    for setting, arenas in settings[1:] if args.smoke else settings:
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        env.update({"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1"})
        if arenas is not None:
            env["MALLOC_ARENA_MAX"] = arenas
        out = subprocess.run([sys.executable, __file__, "--child", "--batches", str(args.batches),
                              *(["--smoke"] if args.smoke else [])], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{setting} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        out = out.stdout
        row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
        row = {"setting": setting, **row, "thread_over_main": round(row["thread_cpu_s"] / row["main_cpu_s"], 3)}
        rows[setting] = row
        print(json.dumps(row), flush=True)
    print(json.dumps({"benchmark": "engine_thread", "smoke": args.smoke, "batches": args.batches,
                      "thread_over_main": {k: r["thread_over_main"] for k, r in rows.items()},
                      "thread_faults": {k: r["thread_faults"] for k, r in rows.items()},
                      "one_arena_thread_cpu_over_default": round(
                          rows["one_arena"]["thread_cpu_s"] / rows["default_arenas"]["thread_cpu_s"], 3)
                      if len(rows) == 2 else None}))


if __name__ == "__main__":
    main()
