"""What TitanRL's vLLM request options save per batch, side by side in one process.

Every request TitanRL sends asks for the sampled token's logprob (`logprobs=0`), and vLLM's
input and output processing run on the engine's thread. Three choices cut that work:
  flat_logprobs  the logprobs as a few flat lists per request, not a dict and a `Logprob` object
                 per generated token (`Completion.of` reads them in one slice);
  detokenize     False: no per-step detokenization and no token string per logprob; the text is
                 decoded once when the request finishes (`titanrl.rollout.vllm.detokenize`);
  tokenize       text prompts tokenized in one batched tokenizer call (`VllmEngine.tokenize`)
                 instead of rendered one by one by vLLM (the baseline sends the text).

This generates the arithmetic example's batch (64 prompts x 8 samples, `VllmEngine.generate`,
one thread) alternately as TitanRL does and with the `--baseline` choices set back to vLLM's
defaults, and prints one JSON line:
  {"titanrl_ms": ..., "baseline_ms": ..., "titanrl_over_baseline": ..., "identical_tokens": ...,
   "identical_texts": ..., "max_logprob_diff": ...}
Times are the median per batch over `--batches` of each (the first two of each are warm-up);
`titanrl_over_baseline` < 1: TitanRL's requests are faster. Both ways must give the same tokens,
texts and logprobs.

    python benchmarks/request_options.py [--batches 12] [--baseline flat_logprobs detokenize tokenize]
    python benchmarks/request_options.py --smoke      # 8 prompts, 3 batches each way: checks it runs
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

from titanrl.config import EngineConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic"
VLLM_DEFAULTS = {"flat_logprobs": False, "detokenize": True}
"""The baseline's value of each request option: vLLM's own default."""
CHOICES = [*VLLM_DEFAULTS, "tokenize"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--baseline", nargs="+", choices=CHOICES, default=CHOICES,
                        help="options the baseline sets to vLLM's default (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="a check that the script runs: 8 prompts, --batches 3 (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.batches = 3  # the first two of each way are warm-up

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
    prompts = [row[cfg.data.prompt_field] for row in rows[: 8 if args.smoke else cfg.rollout.prompts_per_step]]
    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=cfg.model.checkpoint,
            settings=EngineConfig(
                max_model_len=cfg.rollout.engine.max_model_len, max_num_seqs=cfg.rollout.engine.max_num_seqs
            ),
        )
    )
    real = vllm.SamplingParams
    forced = {option: VLLM_DEFAULTS[option] for option in args.baseline if option in VLLM_DEFAULTS}
    text_prompts = "tokenize" in args.baseline

    def baseline_params(*a, **kw):
        return real(*a, **{**kw, **forced})

    def generate(seed: int):
        return engine.generate(prompts, n=cfg.rollout.group_size, temperature=cfg.rollout.sampling.temperature,
                               max_tokens=cfg.rollout.sampling.max_new_tokens, seed=seed)

    times: dict[str, list[float]] = {"titanrl": [], "baseline": []}
    same_tokens, same_texts, max_diff = True, True, 0.0
    for b in range(2 * args.batches):
        way = "titanrl" if b % 2 == 0 else "baseline"
        seed = 1000 + b // 2  # each pair generates the same batch both ways
        baseline = contextlib.ExitStack()
        if way == "baseline":
            baseline.enter_context(mock.patch.object(vllm, "SamplingParams", baseline_params))
            if text_prompts:  # vLLM renders the text itself
                baseline.enter_context(mock.patch.object(engine, "_prompt_inputs", list))
        with baseline:
            start = time.perf_counter()
            out = generate(seed)
            times[way].append(time.perf_counter() - start)
        if way == "titanrl":
            ours = out
            continue
        for a, c in zip((c for g in ours for c in g), (c for g in out for c in g), strict=True):
            same_tokens &= a.token_ids == c.token_ids and a.prompt_token_ids == c.prompt_token_ids
            if a.token_ids == c.token_ids:
                same_texts &= a.text == c.text
                max_diff = max([max_diff, *(abs(x - y) for x, y in zip(a.logprobs, c.logprobs))])
    median = {way: statistics.median(t[2:]) for way, t in times.items()}
    print(
        json.dumps(
            {
                "benchmark": "request_options",
                "smoke": args.smoke,
                "baseline": args.baseline,
                "batches": args.batches,
                "prompts": len(prompts),
                "group_size": cfg.rollout.group_size,
                "titanrl_ms": round(median["titanrl"] * 1e3, 1),
                "baseline_ms": round(median["baseline"] * 1e3, 1),
                "titanrl_over_baseline": round(median["titanrl"] / median["baseline"], 3),
                "identical_tokens": same_tokens,
                "identical_texts": same_texts,
                "max_logprob_diff": max_diff,
                "cpu_flags": isa_flags(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
