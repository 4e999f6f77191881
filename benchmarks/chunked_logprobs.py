"""Peak memory and time of the LM head + token logprobs, full logits vs chunked (one GRPO head pass).

    .venv/bin/python benchmarks/chunked_logprobs.py [--tokens 2048] [--chunks 1024,256] [--vocab 151936]
        [--truncations top_p=0.9,top_k=20,top_k=20+top_p=0.9]
    .venv/bin/python benchmarks/chunked_logprobs.py --smoke   # 256 tokens, vocabulary 8192: checks it runs

Forward and backward of log p(target) for `--tokens` final-norm hidden states (hidden 1024,
Qwen3-0.6B's width) through a `--vocab`-row head, float32, temperature 0.7: the unchunked arm
is what the trainer did before (full logits, grpo.token_logprobs), the others
`chunked_token_logprobs` at each chunk size. Each arm runs in a fresh process, so its peak RSS
(ru_maxrss, minus the RSS once the inputs exist) is its own; the head weight's gradient counts in
every arm. Prints one JSON line per arm and a summary with `chunked_logprobs_peak_ratio` per chunk
size (unchunked peak / chunked peak) and the CPU flags. `--truncations` adds arms at the first
chunk size that score under top-k / top-p (`truncation=`, rollout.sampling.logprobs='sampled'); the summary
gives their time and peak against the untruncated arm at that chunk size.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HIDDEN = 1024


def _truncation(spec: str):  # noqa: ANN202
    """'top_k=20+top_p=0.9' -> Truncation(top_k=20, top_p=0.9); '' -> None."""
    from titanrl.trainer.truncation import Truncation

    if not spec:
        return None
    kw = dict(part.split("=") for part in spec.split("+"))
    return Truncation(top_k=int(kw.get("top_k", 0)), top_p=float(kw.get("top_p", 1.0)))


def arm(tokens: int, vocab: int, chunk: int, truncation: str = "") -> dict:
    """One arm in this process (chunk 0: unchunked)."""
    import torch

    from titanrl.trainer.chunked_logprobs import chunked_token_logprobs
    from titanrl.trainer.grpo import token_logprobs

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, HIDDEN, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if chunk:
        logprobs, _ = chunked_token_logprobs(hidden, weight, targets, 0.7, chunk, truncation=_truncation(truncation))
    else:
        logprobs = token_logprobs(hidden @ weight.t(), targets, 0.7)
    logprobs.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    name = (f"chunk_{chunk}" if chunk else "unchunked") + (f"+{truncation}" if truncation else "")
    return {"arm": name, "tokens": tokens, "vocab": vocab, "hidden": HIDDEN, "truncation": truncation or None,
            "chunk_tokens": chunk or None, "peak_rss_above_inputs_mib": round((peak - base) / 1024),
            "seconds": round(seconds, 2)}


def main() -> None:
    from titanrl.kernels.cpu_build import isa_flags

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", default="1024,256")
    parser.add_argument("--truncations", default="", help="comma-separated, e.g. top_p=0.9,top_k=20+top_p=0.9")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: --tokens 256 --vocab "
                        "8192 --chunks 64 --truncations top_k=20+top_p=0.9 (numbers mean nothing)")
    parser.add_argument("--arm", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one arm
    parser.add_argument("--arm-truncation", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.vocab, args.chunks, args.truncations = 256, 8192, "64", "top_k=20+top_p=0.9"
    if args.arm is not None:
        print(json.dumps(arm(args.tokens, args.vocab, args.arm, args.arm_truncation)))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    plan = [(0, ""), *((c, "") for c in chunks), *((chunks[0], t) for t in args.truncations.split(",") if t)]
    results = []
    for chunk, truncation in plan:
        out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                              "--arm", str(chunk), "--arm-truncation", truncation],
                             check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    truncated = [r for r in results if r["truncation"]]
    results = [r for r in results if not r["truncation"]]
    full = results[0]["peak_rss_above_inputs_mib"]
    print(json.dumps({
        "summary": True, "smoke": args.smoke, "tokens": args.tokens, "vocab": args.vocab,
        "chunked_logprobs_peak_ratio": {r["chunk_tokens"]: round(full / max(r["peak_rss_above_inputs_mib"], 1), 2)
                                        for r in results[1:]},
        "time_ratio": {r["chunk_tokens"]: round(r["seconds"] / results[0]["seconds"], 2) for r in results[1:]},
        # Truncated arms against the untruncated one at the same chunk size.
        "truncated_time_ratio": {r["truncation"]: round(r["seconds"] / results[1]["seconds"], 2) for r in truncated},
        "truncated_peak_ratio": {r["truncation"]: round(r["peak_rss_above_inputs_mib"]
                                                        / max(results[1]["peak_rss_above_inputs_mib"], 1), 2)
                                 for r in truncated},
        "cpu_flags": isa_flags(), "threads": 1,
    }))


if __name__ == "__main__":
    main()
