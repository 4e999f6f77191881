"""Sandbox benchmark: pre-warmed `SandboxPool.run` vs one-shot `run_python_async`.

    .venv/bin/python benchmarks/sandbox_pool.py --out benchmarks/results/sandbox_pool/sandbox_pool.json
    .venv/bin/python benchmarks/sandbox_pool.py --smoke     # 4 calls per arm, concurrency 2: checks it runs

Both arms run the same trivial program (`print(sum(range(1000)))`) in the same process:

1. Latency: `--calls` sequential calls per arm, alternating one-shot / pool call by call so
   machine load hits both alike; a one-shot call starts bubblewrap and the runner, runs the
   program and tears the sandbox down; a pool call (size 1, started before timing) only forks
   and execs the program inside the warm sandbox.
2. Throughput: `--calls` calls issued at once with concurrency `--concurrency` (an asyncio
   semaphore for one-shot, the pool size for the pool), calls per second.

Ratios are one-shot / pool (latency) and pool / one-shot (throughput): > 1 means the pool wins.
Pool start-up (all slots, concurrently) is reported separately. Runtime ~10-20 s on 2 cores.
Prints the report as one JSON line (`--out` keeps it indented).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

from titanrl.envs import SandboxConfig, SandboxPool, run_python_async

PROGRAM = "print(sum(range(1000)))"


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    return {"median_ms": round(statistics.median(ms), 2), "mean_ms": round(statistics.fmean(ms), 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2), "min_ms": round(ms[0], 2)}


async def _timed(coro) -> float:
    start = time.perf_counter()
    result = await coro
    assert result.ok, result
    return time.perf_counter() - start


async def latency(config: SandboxConfig, calls: int) -> dict:
    one_shot, pooled = [], []
    async with SandboxPool(size=1, config=config) as pool:
        await pool.run(PROGRAM)  # Warm-up: page cache, first fork.
        await run_python_async(PROGRAM, config=config)
        for _ in range(calls):
            one_shot.append(await _timed(run_python_async(PROGRAM, config=config)))
            pooled.append(await _timed(pool.run(PROGRAM)))
    a, b = _summary(one_shot), _summary(pooled)
    return {"one_shot": a, "pool": b, "ratio_one_shot_over_pool_median": round(a["median_ms"] / b["median_ms"], 2)}


async def throughput(config: SandboxConfig, calls: int, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await _timed(run_python_async(PROGRAM, config=config))

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    one_shot = calls / (time.perf_counter() - start)

    start = time.perf_counter()
    pool = SandboxPool(size=concurrency, config=config)
    await pool.start()
    startup_s = time.perf_counter() - start
    try:
        start = time.perf_counter()
        await asyncio.gather(*(_timed(pool.run(PROGRAM)) for _ in range(calls)))
        pooled = calls / (time.perf_counter() - start)
    finally:
        await pool.close()
    return {"concurrency": concurrency, "one_shot_calls_per_s": round(one_shot, 1),
            "pool_calls_per_s": round(pooled, 1), "ratio_pool_over_one_shot": round(pooled / one_shot, 2),
            "pool_startup_s": round(startup_s, 3)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--isolation", choices=["bwrap", "rlimits"], default="bwrap")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true",
                        help="a check that the script runs: --calls 4 --concurrency 2 (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps no results: drop --out")
        args.calls, args.concurrency = 4, 2
    config = SandboxConfig(isolation=args.isolation)
    report = {
        "benchmark": "sandbox_pool",
        "smoke": args.smoke,
        "isolation": args.isolation,
        "program": PROGRAM,
        "calls": args.calls,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "latency": await latency(config, args.calls),
        "throughput": await throughput(config, args.calls, args.concurrency),
    }
    print(json.dumps(report), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
