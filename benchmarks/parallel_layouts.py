"""Parallel layouts benchmark: one GRPO step per layout vs the single-process trainer.

    .venv/bin/python benchmarks/parallel_layouts.py [LAYOUT ...] [--tied] [--moe] [--family F] [--out FILE [--append]]
    .venv/bin/python benchmarks/parallel_layouts.py --smoke    # fsdp and pp (with --moe: ep): checks it runs

For each layout (default: all of `support.layout_check.LAYOUTS`: fsdp, ddp, tp,
tp_sp, pp (1F1B), pp_gpipe, pp_interleaved, cp with 2 gloo processes; hsdp, fsdp+tp, fsdp+tp_sp,
fsdp+cp, cp+tp_sp, pp+fsdp, pp+tp, pp+cp, cp4, pp4 with 4), processes on 127.0.0.1 run
`GRPOStep` on the same packed batch (16 rows of a 4-layer tiny Qwen3, micro-batches of
3 rows) that `GRPOTrainer.accumulate_gradients` runs in this process, and one JSON line per
layout is printed:

  loss_rel_diff             |loss - ref| / |ref| (token-mean GRPO loss)
  grad_rel_diff             ||g - g_ref||_2 / ||g_ref||_2, all parameters concatenated (relative L2),
                            g gathered in full with iter_full_gradients
  grad_max_param_rel_diff   the largest per-parameter relative L2 (stricter)
  grad_norm_rel_diff        the distributed global gradient norm vs the reference's
  update_rel_diff           relative L2 of the first clipped AdamW update (ill-conditioned: Adam's
                            first step is ~lr*sign(g), so near-zero gradient elements amplify noise)
  step_s / warm_step_s      slowest rank's accumulate_gradients + clip_and_step, first / second step
  ref_step_s / ref_warm_step_s  the single-process trainer's
  tied_copies_equal         --tied, pipeline layouts: the first and last stages' copies of the tied
                            embedding / LM head are bitwise equal after two optimizer steps (else null)

benchmarks/results/parallel_layouts/parallel_layouts.jsonl holds an untied run of every layout
followed by a tied one (`--tied --out ... --append`).

--moe runs the tiny mixture-of-experts policy (layout_check.TINY_MOE: layers 1-3 route each
token to 2 of 4 experts, init std 0.2 so routing varies) under every layout, by default, the
expert-parallel ones included: ep (experts over dp_shard=2), tp_sp+ep (over the tp ranks),
fsdp+ep (dp_shard=4 as 2 x ep=2), ep4, hsdp+ep, fsdp+tp_sp+ep; ep=1 layouts replicate the
sparse blocks over tp. benchmarks/results/parallel_layouts/parallel_layouts_moe.jsonl holds
such a run.

--family llama / qwen2 runs the same 4-layer shape as another dense family
(layout_check.FAMILY_OVERRIDES): Llama with biases on q/k/v/o and gate/up/down (tp shards the
column-parallel biases and replicates the row-parallel ones), Qwen2 with its q/k/v biases; neither
has q/k norms. benchmarks/results/parallel_layouts/parallel_layouts_{llama,qwen2}.jsonl hold an
untied run of every dense layout followed by a tied run of the pipeline layouts.

Target: loss and gradient differences <= 1e-5. Runtime ~1.5 min on 2 shared cores (4-process
worlds oversubscribe them; step times here measure overheads, not speed-ups).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

from titanrl.config import ParallelConfig
from titanrl.trainer.parallel.launch import run_local_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness the tests use
from support.layout_check import (  # noqa: E402
    EXPERT_PARALLEL,
    FAMILY_OVERRIDES,
    LAYOUTS,
    check_layouts,
    make_case,
    reference,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layouts", nargs="*", help=f"any of {list(LAYOUTS)} (default: all that fit the policy)")
    parser.add_argument("--tied", action="store_true", help="tied embedding / LM head")
    parser.add_argument("--moe", action="store_true", help="the tiny mixture-of-experts policy (ep layouts need it)")
    parser.add_argument("--family", default="qwen3", choices=list(FAMILY_OVERRIDES),
                        help="dense model family of the policy (default qwen3)")
    parser.add_argument("--out", help="also write the JSON lines here (replacing the file)")
    parser.add_argument("--append", action="store_true", help="append to --out instead of replacing it")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: by default the layouts "
                        "fsdp and pp (with --moe: fsdp and ep), one world of 2 processes; nothing kept")
    args = parser.parse_args()
    if args.smoke and args.out:
        parser.error("--smoke keeps no results: drop --out")
    names = args.layouts or [n for n in LAYOUTS if args.moe or n not in EXPERT_PARALLEL]
    if args.smoke and not args.layouts:  # ~5 s per layout on 2 cores
        names = ["fsdp", "ep" if args.moe else "pp"]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        case = make_case(tmp, tied=args.tied, moe=args.moe, family=args.family)
        ref = reference(case)
        by_world: dict[int, list[str]] = {}
        for name in names:
            by_world.setdefault(ParallelConfig(**LAYOUTS[name]).world_size, []).append(name)
        for world, group in sorted(by_world.items()):
            for report in run_local_world(check_layouts, world, group, case, ref, timeout_s=900)[0]:
                line = json.dumps(report)
                print(line, flush=True)
                lines.append(line)
    worst = max(max(json.loads(x)[k] for k in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff"))
                for x in lines)
    print(
        json.dumps(
            {
                "summary": f"{len(lines)} layouts",
                "smoke": args.smoke,
                "family": args.family,
                "max_loss_or_grad_rel_diff": worst,
                "target": 1e-5,
                "ok": worst <= 1e-5,
                "torch": torch.__version__,
                "machine": platform.machine(),
                "threads_per_process": 1,
            }
        ),
        flush=True,
    )
    if args.out:
        with Path(args.out).open("a" if args.append else "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
