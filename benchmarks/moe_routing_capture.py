"""Cost of recording routed experts in vLLM (`VllmEngineConfig.record_routed_experts`).

    .venv/bin/python benchmarks/moe_routing_capture.py --out benchmarks/results/moe_routing_capture/moe_routing_capture.jsonl
    .venv/bin/python benchmarks/moe_routing_capture.py --smoke   # 4 prompts x n=2 x 8 tokens, 1 repeat: checks it runs

One tiny Qwen3-MoE checkpoint (hidden 128, 2 sparse layers, 4 experts, top-2, byte tokenizer,
float32), two in-process engines on it in the same process, one recording routing and one not;
the timed `VllmEngine.generate` calls alternate between them after one warm-up each, so load
from other processes hits both arms alike. Workload: `--prompts` prompts x n=`--n` x up to
`--max-tokens` tokens, temperature 1, the same seeds in both arms (recording does not change
what is computed: `same_tokens` checks it). Reports completion tokens per second (median of
`--repeats`) per arm and their ratio, with the CPU flags (ratios move with the machine).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from titanrl.config import EngineConfig


def main() -> None:
    from titanrl.kernels.cpu_build import isa_flags

    from titanrl.models.qwen3.moe import Qwen3MoeConfig
    from titanrl.models.tiny import tiny_config, write_checkpoint
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="append the result as one JSON line here")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: --prompts 4 --n 2 "
                        "--max-tokens 8 --repeats 1 (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps no results: drop --out")
        args.prompts, args.n, args.max_tokens, args.repeats = 4, 2, 8, 1

    config = Qwen3MoeConfig(**{**dataclasses.asdict(tiny_config()), "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 64})
    prompts = [f"prompt {i}: " + "ab" * (i % 7) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", config, seed=3, std=0.1)
        engines = {
            record: VllmEngine(
                VllmEngineConfig(
                    checkpoint=str(ckpt),
                    settings=EngineConfig(
                        max_model_len=256, max_num_seqs=args.prompts * args.n, record_routed_experts=record
                    ),
                )
            )
            for record in (False, True)
        }
        times: dict[bool, list[float]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {}
        for repeat in range(args.repeats + 1):
            for record in ((False, True) if repeat % 2 else (True, False)):
                t0 = time.perf_counter()
                out = engines[record].generate(prompts, n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                                               seed=repeat)
                elapsed = time.perf_counter() - t0
                if repeat:  # the first round warms up
                    times[record].append(elapsed)
                tokens[record] = [c.token_ids for g in out for c in g]
        for engine in engines.values():
            engine.close()
    num_tokens = sum(len(t) for t in tokens[True])
    rate = {record: num_tokens / statistics.median(times[record]) for record in times}
    result = {
        "benchmark": "moe_routing_capture",
        "smoke": args.smoke,
        "workload": f"{args.prompts} prompts x n={args.n} x <= {args.max_tokens} tokens",
        "completion_tokens": num_tokens,
        "tok_per_s_off": round(rate[False], 1),
        "tok_per_s_recording": round(rate[True], 1),
        "ratio_recording_over_off": round(rate[True] / rate[False], 3),
        "same_tokens": tokens[True] == tokens[False],
        "repeats": args.repeats,
        "cpu_flags": isa_flags(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
