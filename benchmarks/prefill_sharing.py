"""How much of a GRPO group's prompt its samples share in vLLM, by KV-cache block size.

vLLM's prefix cache shares whole KV blocks. A group is one request with `n` samples; its
children hit the blocks the first child fills in the same step, but only whole blocks. vLLM's
CPU default block (128 tokens) therefore shares nothing of prompts shorter than 128 tokens, and
every sample prefills its prompt again. This script times the rollout engine
(`titanrl.rollout.vllm.engine.VllmEngine`, 1 thread) on the reasoning example's workload:
SmolLM2-135M-Instruct (`titanrl models get`, cached), chain_sum prompts under the chat template
(~85 tokens), per `--block-sizes` arm in a fresh process:

    prefill     16 prompts x 8 samples, 1 new token (what the block size changes)
    rollout     16 other prompts x 8 samples, 64 new tokens at temperature 1 (a whole step's batch)

Each measurement uses prompts no earlier call saw. One JSON line per arm, then a summary with
`prefill_speedup` and `rollout_speedup` of each block size over the first (the baseline, 128).

    .venv/bin/python benchmarks/prefill_sharing.py [--block-sizes 128,32] [--out benchmarks/results/prefill_sharing/prefill_sharing.jsonl]
    .venv/bin/python benchmarks/prefill_sharing.py --smoke    # the tiny byte-level model instead: checks it runs

`--smoke` runs the same arms on titanrl.models.tiny's random 0.4M model (nothing to download) with
prompts of a similar length in its byte tokens (~70), one after the other in this process; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from titanrl.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, NEW_TOKENS = 16, 8, 64


def smoke_prompts(count: int) -> list[str]:
    """`--smoke`: distinct prompts of ~70 bytes (= tokens of the tiny model's byte tokenizer)."""
    return [f"Question {i}: what is {i * 7 % 90 + 10} + {i * 13 % 90 + 10}? Work it out, then end with 'Answer: N'.\n"
            for i in range(count)]


def measure(block_size: int, smoke: bool = False) -> dict:
    """One arm, in this process: start the engine, warm it, time prefill then rollout."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples" / "reasoning"))
    from task import chain_sum_data, model_checkpoint
    from transformers import AutoTokenizer

    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    if smoke:
        import tempfile

        from titanrl.models.tiny import write_tiny_checkpoint

        scratch = tempfile.TemporaryDirectory()  # removed when this process ends
        checkpoint = str(write_tiny_checkpoint(Path(scratch.name) / "tiny", seed=0))
        prompts = smoke_prompts(3 * PROMPTS)
    else:
        checkpoint = model_checkpoint()
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        rows = chain_sum_data().train_rows.select(range(3 * PROMPTS))
        prompts = [
            tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows
        ]
    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=checkpoint,
            settings=EngineConfig(max_model_len=256, max_num_seqs=PROMPTS * GROUP, kv_cache_gib=2.0),
            kv_block_size=block_size,
        )
    )
    engine.generate(prompts[-2:], n=2, max_tokens=4, seed=0)  # warm-up on prompts not timed

    def timed(batch: list[str], max_tokens: int) -> tuple[float, int]:
        start = time.perf_counter()
        groups = engine.generate(batch, n=GROUP, temperature=1.0, max_tokens=max_tokens, seed=1)
        return time.perf_counter() - start, sum(len(c.token_ids) for g in groups for c in g)

    prefill_s, _ = timed(prompts[:PROMPTS], 1)
    rollout_s, tokens = timed(prompts[PROMPTS:2 * PROMPTS], NEW_TOKENS)
    prompt_tokens = sum(len(t) for t in engine.tokenize(prompts[:PROMPTS])) / PROMPTS
    engine.close()
    return {"block_size": block_size, "prefill_s": round(prefill_s, 3), "rollout_s": round(rollout_s, 3),
            "rollout_new_tokens": tokens, "prompt_tokens_mean": round(prompt_tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", default="128,32", help="comma-separated; the first is the baseline")
    parser.add_argument("--out", default="", help="also append the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: the same arms on the "
                        "tiny random model, in this process (numbers mean nothing)")
    parser.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        print(json.dumps(measure(args.arm, args.smoke)), flush=True)
        return
    if args.smoke and args.out:
        parser.error("--smoke keeps no results: drop --out")
    from titanrl.kernels.cpu_build import isa_flags

    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false")
    lines = []
    for size in (int(s) for s in args.block_sizes.split(",")):
        if args.smoke:  # the arms in this process, one after the other: one vLLM import instead of one per arm
            arm = measure(size, smoke=True)
        else:
            out = subprocess.run([sys.executable, __file__, "--arm", str(size)], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"block size {size} failed:\n{out.stderr[-3000:]}")
            arm = json.loads(out.stdout.strip().splitlines()[-1])
        record = {
            "benchmark": "prefill_sharing",
            "smoke": args.smoke,
            **arm,
            "prompts": PROMPTS,
            "group_size": GROUP,
            "max_new_tokens": NEW_TOKENS,
            "cpu_flags": isa_flags(),
            "loadavg": round(os.getloadavg()[0], 2),
        }
        lines.append(record)
    base = lines[0]
    summary = {"benchmark": "prefill_sharing", "summary": True, "smoke": args.smoke,
               "baseline_block_size": base["block_size"],
               **{f"prefill_speedup_{r['block_size']}": round(base["prefill_s"] / r["prefill_s"], 3) for r in lines[1:]},
               **{f"rollout_speedup_{r['block_size']}": round(base["rollout_s"] / r["rollout_s"], 3) for r in lines[1:]}}
    for record in [*lines, summary]:
        print(json.dumps(record), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
