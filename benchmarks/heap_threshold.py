"""The trainer's glibc mmap threshold (train.memory.heap_mmap_threshold_mib) on issue 21's 19M step,
side by side in one process.

Every host allocation at or above the threshold is a fresh mapping from the kernel, returned
on free: the trainer pays a page fault (and the kernel's zeroing) for every 4 KiB it writes
into such a tensor, and a TLB shoot-down across its threads for every unmap. The 4 MiB
default keeps a Qwen3-0.6B-shaped trainer's resident memory down (benchmarks/trainer_memory.py);
this measures what it costs a small model whose activations are a few MiB each.

One `GRPOTrainer.step` on the 19M model (benchmarks/trainer_step.py's `19m`, 8 prompts x 8
samples of varied lengths, packed with shared prompts, float32) per threshold, each in a process
of its own (glibc's heap state carries from step to step, so each threshold is measured in its
steady state), the processes run one after another in alternating order over `--rounds`.
Prints one JSON line per threshold and a summary:
  {"threshold_mib": ..., "step_s": ..., "minor_faults_per_step": ..., "system_cpu_s_per_step": ..., "speedup_vs_first": ...}
Medians over all rounds' steps (each process takes one warm-up step, then `--repeats`);
`speedup_vs_first` is the first listed threshold's step time over this one's; 0 is glibc's own
behaviour (train.memory.heap_mmap_threshold_mib=0).

    python benchmarks/heap_threshold.py [--thresholds 4,16,32,0] [--repeats 4] [--rounds 2] [--threads 2]
    python benchmarks/heap_threshold.py --smoke    # the tiny model, 8 rows, thresholds 4,0: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from titanrl.trainer.setup import TrainerSetup

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainer_step's workload


def child(mib: int, repeats: int, threads: int, smoke: bool = False) -> None:
    """(In the child process.) `repeats` timed steps at threshold `mib`; prints one JSON line of lists."""
    from titanrl.config import ComputeConfig, MemoryConfig, ModelConfig, TrainConfig
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer import GRPOTrainer
    from trainer_step import LAYOUTS, SIZES, _groups

    size = "tiny" if smoke else "19m"
    groups = _groups(8, 8, 8, varied=True) if smoke else _groups(64, 30, 64, varied=True)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / size, seed=0, **SIZES[size])
        trainer = GRPOTrainer(
            TrainerSetup(
                ModelConfig(checkpoint=str(checkpoint), dtype="float32"),
                TrainConfig(
                    compute=ComputeConfig(device="cpu", threads=threads, **LAYOUTS["shared"]),
                    memory=MemoryConfig(micro_batch_size=64, heap_mmap_threshold_mib=mib),
                ),
                temperature=1.0,
                seed=0,
            )
        )
        trainer.step(groups)  # warm-up: kernels, AdamW's state, the heap
        steps = []
        for _ in range(repeats):
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            trainer.step(groups)
            elapsed = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            steps.append((elapsed, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))
    print(json.dumps(steps), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--thresholds", default="4,16,32,0", help="comma-separated MiB values (0: glibc's own)")
    parser.add_argument("--repeats", type=int, default=4, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per threshold, in alternating order")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: the tiny model, 8 "
                        "rows, --thresholds 4,0 --repeats 1 --rounds 1 --threads 1 (numbers mean nothing)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.repeats, args.threads, args.smoke)
    if args.smoke:
        args.thresholds, args.repeats, args.rounds, args.threads = "4,0", 1, 1, 1
    thresholds = [int(v) for v in args.thresholds.split(",")]
    if min(thresholds) < 0:
        parser.error("--thresholds: every value must be >= 0 MiB")

    from titanrl.kernels.cpu_build import isa_flags

    samples: dict[int, list[list[float]]] = {mib: [] for mib in thresholds}
    for r in range(args.rounds):
        for mib in (thresholds if r % 2 == 0 else thresholds[::-1]):
            out = subprocess.run([sys.executable, __file__, "--child", str(mib), "--repeats", str(args.repeats),
                                  "--threads", str(args.threads), *(["--smoke"] if args.smoke else [])],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"threshold {mib} MiB failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            samples[mib] += json.loads(out.stdout.strip().splitlines()[-1])
    first = statistics.median(s[0] for s in samples[thresholds[0]])
    for mib in thresholds:
        step_s = statistics.median(s[0] for s in samples[mib])
        print(json.dumps({
            "benchmark": "heap_threshold", "threshold_mib": mib, "step_s": round(step_s, 4),
            "minor_faults_per_step": round(statistics.median(s[1] for s in samples[mib])),
            "system_cpu_s_per_step": round(statistics.median(s[2] for s in samples[mib]), 3),
            "speedup_vs_first": round(first / step_s, 3),
        }), flush=True)
    print(
        json.dumps(
            {
                "benchmark": "heap_threshold",
                "summary": True,
                "smoke": args.smoke,
                "model": "tiny" if args.smoke else "19m",
                "rows": 8 if args.smoke else 64,
                "threads": args.threads,
                "repeats": args.repeats,
                "rounds": args.rounds,
                "cpu_flags": isa_flags(),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
