"""Flat logprobs: what asking vLLM for `FlatLogprobs` saves per batch, side by side in one process.

Every request TitanRL sends asks for the sampled token's logprob (`logprobs=0`). vLLM keeps
those as a dict of one `Logprob` object per generated token unless the request asks for
`flat_logprobs` (a few flat lists per request), and its output processing builds them on the
engine's thread every step. TitanRL's requests ask for flat logprobs, and `Completion.of`
reads them in one slice (`titanrl.rollout.vllm.engine.sampled_logprobs`).

This generates the arithmetic example's batch (64 prompts x 8 samples, `VllmEngine.generate`,
one thread) alternately as TitanRL does (flat) and with `flat_logprobs=False` forced onto every
request (the baseline: vLLM's default), and prints one JSON line:
  {"flat_ms": ..., "dict_ms": ..., "flat_over_dict": ..., "identical_tokens": ..., "max_logprob_diff": ...}
Times are the median per batch over `--batches` of each (the first two of each are warm-up);
`flat_over_dict` < 1: flat is faster. Both ways must give the same tokens and logprobs.

    python benchmarks/flat_logprobs.py [--batches 12]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=12)
    args = parser.parse_args()

    import torch
    import vllm

    from titanrl.cli import load_config_file
    from titanrl.jsonl import read_json_lines
    from titanrl.kernels.cpu_build import isa_flags
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLE))  # the config imports its task module
    cfg = load_config_file(str(EXAMPLE / "config.py"))
    rows = read_json_lines(EXAMPLE / "data" / "train.jsonl").values()
    prompts = [row[cfg.data.prompt_field] for row in rows[: cfg.rollout.prompts_per_step]]
    engine = VllmEngine(VllmEngineConfig(checkpoint=cfg.model.checkpoint, max_model_len=cfg.rollout.max_model_len,
                                         max_num_seqs=cfg.rollout.max_num_seqs))
    real = vllm.SamplingParams

    def dict_logprobs(*a, **kw):  # the baseline: vLLM's default per-token dicts
        return real(*a, **{**kw, "flat_logprobs": False})

    def generate(seed: int):
        return engine.generate(prompts, n=cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                               max_tokens=cfg.rollout.max_new_tokens, seed=seed)

    times: dict[str, list[float]] = {"flat": [], "dict": []}
    same_tokens, max_diff = True, 0.0
    for b in range(2 * args.batches):
        way = "flat" if b % 2 == 0 else "dict"
        seed = 1000 + b // 2  # each pair generates the same batch both ways
        with mock.patch.object(vllm, "SamplingParams", dict_logprobs) if way == "dict" else contextlib.nullcontext():
            start = time.perf_counter()
            out = generate(seed)
            times[way].append(time.perf_counter() - start)
        if way == "flat":
            flat_out = out
        else:
            for a, c in zip((c for g in flat_out for c in g), (c for g in out for c in g), strict=True):
                same_tokens &= a.token_ids == c.token_ids
                if a.token_ids == c.token_ids:
                    max_diff = max([max_diff, *(abs(x - y) for x, y in zip(a.logprobs, c.logprobs))])
    median = {way: statistics.median(t[2:]) for way, t in times.items()}
    print(json.dumps({
        "benchmark": "flat_logprobs", "batches": args.batches, "prompts": len(prompts), "group_size": cfg.rollout.group_size,
        "flat_ms": round(median["flat"] * 1e3, 1), "dict_ms": round(median["dict"] * 1e3, 1),
        "flat_over_dict": round(median["flat"] / median["dict"], 3),
        "identical_tokens": same_tokens, "max_logprob_diff": max_diff, "cpu_flags": isa_flags(),
    }), flush=True)


if __name__ == "__main__":
    main()
