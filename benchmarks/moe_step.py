"""GRPO step of a small Qwen3-MoE: tokens/s with ep=1 vs ep=2 (gloo) and grouped matmul vs a per-expert loop.

    .venv/bin/python benchmarks/moe_step.py [--repeats 5] [--rows 32] [--device cpu|cuda] [--dtype float32]
        [--out FILE]
    .venv/bin/python benchmarks/moe_step.py --smoke     # 8 rows, 1 repeat, 2 of the arms: checks it runs

The policy: hidden 256, 4 layers, 8 experts per layer routed top-2 (expert width 256), head_dim
64, the byte tokenizer's vocabulary; one step = `GRPOStep.accumulate_gradients` +
`clip_and_step` on `--rows` sequences of 16 prompt + 32 completion tokens. Arms:

  ep1_grouped_mm / ep1_loop   one process (one thread), experts by `torch._grouped_mm` / a loop
  ep2_grouped_mm / ep2_loop   two gloo processes (one thread each), parallel.dp_shard=2 with ep=2:
                              each rank holds 4 experts and half the rows; tokens cross by all-to-all

Each arm warms up with one step, then times `--repeats` steps; one JSON line per arm (median step
time, trained tokens/s, and the ratio to ep1_grouped_mm measured in the same run) and a summary
line. ep=2 uses two cores for the work ep=1 does on one, so its ratio mixes the speed-up of the
second core with the all-to-all's cost; on a GPU (`--device cuda`, bf16) only the ep=1 arms run
(one device).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

SMALL_MOE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
PROMPT_LEN, COMPLETION_LEN = 16, 32


def _write_policy(out: Path) -> Path:
    from titanrl.models.qwen3.moe import Qwen3MoeConfig
    from titanrl.models.tiny import tiny_config, write_checkpoint

    base = tiny_config(**{k: v for k, v in SMALL_MOE.items() if k in {f.name for f in dataclasses.fields(tiny_config())}})
    config = Qwen3MoeConfig(**{**vars(base), **{k: SMALL_MOE[k] for k in ("num_experts", "num_experts_per_tok",
                                                                            "moe_intermediate_size")}})
    return write_checkpoint(out, config, seed=0, std=0.1)


def _batch(rows: int):
    from titanrl.trainer.batch import pack
    from titanrl.types import Group, Sample

    g = torch.Generator().manual_seed(0)
    groups = []
    for gid in range(rows // 8):
        samples = [Sample(prompt="", completion="", prompt_ids=torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist(),
                          completion_ids=torch.randint(0, 256, (COMPLETION_LEN,), generator=g).tolist(),
                          gen_logprobs=[-5.5] * COMPLETION_LEN, reward=float(k % 3), group_id=gid, policy_version=0)
                   for k in range(8)]
        groups.append(Group(samples))
    return pack(groups, pad_id=0, current_version=0)


def time_steps(rank: int, world_size: int, checkpoint: str, rows: int, implementation: str, repeats: int,
               device: str, dtype: str) -> dict | None:
    """Warm-up + `repeats` timed GRPO steps under dp_shard=ep=world_size (call on every rank)."""
    from titanrl.config import MemoryConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from titanrl.models.hf_checkpoint import load_model
    from titanrl.models.qwen3.moe import GroupedExperts
    from titanrl.trainer.optimizer import build_optimizers
    from titanrl.trainer.parallel.mesh import build_mesh
    from titanrl.trainer.parallel.parallelize import parallelize
    from titanrl.trainer.step import GRPOStep

    parallel = ParallelConfig(dp_shard=world_size, ep=world_size)
    model, _ = load_model(checkpoint, dtype=getattr(torch, dtype))
    mesh = build_mesh(parallel, device)
    pm = parallelize(model, parallel, mesh, device_type=device)
    for part in pm.parts:
        for module in part.modules():
            if isinstance(module, GroupedExperts):
                module.implementation = implementation
    train = TrainConfig(memory=MemoryConfig(micro_batch_size=rows), optimizer=OptimizerConfig(lr=1e-4))
    step = GRPOStep(pm, build_optimizers(pm, train), train, 1.0)
    batch = _batch(rows)
    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        if world_size > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        stats = step.accumulate_gradients(batch)
        step.clip_and_step(stats)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if world_size > 1:
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if i > 0:  # the first step is the warm-up
            times.append(elapsed.item())
    if torch.distributed.get_rank() != 0:
        return None
    return {"step_s": statistics.median(times), "tokens": int(stats.tokens), "times": [round(t, 4) for t in times]}


def _run(world_size: int, *args) -> dict:
    """Every arm in its own spawned world (one process for ep=1), so the arms start alike."""
    from titanrl.trainer.parallel.launch import run_local_world

    return run_local_world(time_steps, world_size, *args, timeout_s=900)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=32, help="sequences per step (a multiple of 8)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true",
                        help="a check that the script runs: --rows 8 --repeats 1, arms ep1_grouped_mm and ep2_loop "
                             "(numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps no results: drop --out")
        args.rows, args.repeats = 8, 1
    torch.set_num_threads(1)
    worlds = [1] if args.device == "cuda" else [1, 2]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(_write_policy(Path(tmp) / "moe"))
        results = {}
        arms = [(world, impl) for world in worlds for impl in ("grouped_mm", "loop")]
        if args.smoke:  # each arm is a world of its own (~7 s to start): one of each size, one of each implementation
            arms = [arm for arm in arms if arm in {(1, "grouped_mm"), (2, "loop")}]
        for world, impl in arms:
            results[(world, impl)] = _run(world, ckpt, args.rows, impl, args.repeats, args.device, args.dtype)
    base = results[(1, "grouped_mm")]["step_s"]
    for (world, impl), r in results.items():
        lines.append({"benchmark": "moe_step", "arm": f"ep{world}_{impl}", "ep": world, "processes": world,
                      "experts": impl, "device": args.device, "dtype": args.dtype, "step_s": round(r["step_s"], 4),
                      "tokens_per_s": round(r["tokens"] / r["step_s"], 1),
                      "vs_ep1_grouped_mm": round(base / r["step_s"], 3), "step_times_s": r["times"]})
    lines.append({"benchmark": "moe_step", "summary": True, "smoke": args.smoke, "model": SMALL_MOE, "rows": args.rows,
                  "seq_len": PROMPT_LEN + COMPLETION_LEN - 1, "repeats": args.repeats, "threads_per_process": 1,
                  "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
                  "grouped_mm_in_torch": hasattr(torch, "_grouped_mm")})
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
