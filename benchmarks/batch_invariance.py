"""What batch-invariant mode costs: generator and trainer time with it off and on, side by side.

    .venv/bin/python benchmarks/batch_invariance.py [--out benchmarks/results/batch_invariance/batch_invariance.json]
    .venv/bin/python benchmarks/batch_invariance.py --smoke   # the demo model, 8 prompts x 4 x 8 tokens, 1 repeat

For two models, the demo's warm start (examples/arithmetic/warm_start, 0.5M params) and the
25M-parameter model of benchmarks/rollout_engine.py (hidden 512, 8 layers, head_dim 64):

- generator: one in-process vLLM engine with `batch_invariant=False` and one with `True`, both
  alive at once; timed `generate` calls alternate between them (off, on, on, off, ...) after a
  warm-up each, so load from other processes hits both alike. Workload: 64 prompts x 8
  samples x 32 tokens (eos ignored), temperature 1, seeded.
- trainer: two GRPOTrainers (off / on) on the same GRPO batch of 64 sequences (16-token
  prompts, 32-token completions); one forward + backward (`accumulate_gradients`) per timed
  run, alternating the same way.

`gen_ratio` / `train_ratio` = median time with the mode on / median time off (>= 1 means it
costs). The printed JSON line holds both models' numbers and the worst ratio of each kind.
Target (issue 7): at most 1.5.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from titanrl.config import EngineConfig
from titanrl.trainer.setup import TrainerSetup

ROOT = Path(__file__).resolve().parent.parent
MEDIUM = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              intermediate_size=1536)
PROMPTS, SAMPLES, TOKENS, PROMPT_LEN = 64, 8, 32, 16


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j + 1) % 256 for j in range(PROMPT_LEN)] for i in range(PROMPTS)]


def _alternate(run_off, run_on, repeats: int) -> dict[str, float]:
    """Median seconds of each arm, timed in alternating order after one warm-up each."""
    run_off(), run_on()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(repeats):
        order = (("off", run_off), ("on", run_on)) if r % 2 == 0 else (("on", run_on), ("off", run_off))
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"off_s": off, "on_s": on, "ratio": on / off}


def measure_generator(checkpoint: str, repeats: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    engines = {
        flag: VllmEngine(
            VllmEngineConfig(
                checkpoint=checkpoint,
                settings=EngineConfig(max_model_len=PROMPT_LEN + TOKENS, max_num_seqs=512),
                batch_invariant=flag,
            )
        )
        for flag in (False, True)
    }
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0, seed=0)

    def run(flag: bool):
        return lambda: engines[flag].llm.generate(prompts, params, use_tqdm=False)

    try:
        result = _alternate(run(False), run(True), repeats)
    finally:
        for engine in engines.values():
            engine.close()
    tokens = PROMPTS * SAMPLES * TOKENS
    return {**result, "tokens_per_s_off": tokens / result["off_s"], "tokens_per_s_on": tokens / result["on_s"]}


def measure_trainer(checkpoint: str, repeats: int) -> dict[str, float]:
    from titanrl.config import MemoryConfig, ModelConfig, TrainConfig
    from titanrl.trainer.batch import pack
    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.types import Group, Sample

    g = torch.Generator().manual_seed(0)
    groups = []
    for j, prompt in enumerate(_prompts()[: PROMPTS // SAMPLES]):
        samples = []
        for i in range(SAMPLES):
            completion = torch.randint(0, 256, (TOKENS,), generator=g).tolist()
            samples.append(Sample("p", "c", prompt, completion, [-5.0] * TOKENS, float(i % 3), j, 0))
        groups.append(Group(samples))
    trainers = {
        flag: GRPOTrainer(
            TrainerSetup(
                ModelConfig(checkpoint=checkpoint),
                TrainConfig(memory=MemoryConfig(micro_batch_size=64)),
                1.0,
                0,
                batch_invariant=flag,
            )
        )
        for flag in (False, True)
    }
    batch = pack(groups, 0)

    def run(flag: bool):
        return lambda: trainers[flag].accumulate_gradients(batch)

    result = _alternate(run(False), run(True), repeats)
    tokens = PROMPTS * (PROMPT_LEN + TOKENS)
    return {**result, "tokens_per_s_off": tokens / result["off_s"], "tokens_per_s_on": tokens / result["on_s"]}


def in_product_mkl_mode() -> None:
    """Restarts this script with the MKL mode a batch-invariant run's actors get (`actor_env`:
    MKL_CBWR=AVX2,STRICT on Intel CPUs with AVX-512, nothing elsewhere). MKL takes the mode only
    before its first GEMM, and the off arm runs GEMMs before the on arm's kernels ask for it; both
    arms then run in that mode, as both would inside a batch-invariant run's processes."""
    from titanrl.kernels.mkl_mode import actor_env

    wanted = actor_env()
    if any(os.environ.get(k) != v for k, v in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **wanted})


def main() -> None:
    in_product_mkl_mode()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: the demo model only, "
                        "8 prompts x 4 samples x 8 tokens, --repeats 1 (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps no results: drop --out")
        global PROMPTS, SAMPLES, TOKENS
        PROMPTS, SAMPLES, TOKENS, args.repeats = 8, 4, 8, 1
    from titanrl.kernels.cpu_build import isa_flags
    from titanrl.models.tiny import write_tiny_checkpoint

    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": str(ROOT / "examples" / "arithmetic" / "warm_start")}
        if not args.smoke:
            models["medium_25m"] = str(write_tiny_checkpoint(Path(tmp) / "medium", seed=0, **MEDIUM))
        for name, ckpt in models.items():
            results[name] = {"generator": measure_generator(ckpt, args.repeats),
                             "trainer": measure_trainer(ckpt, args.repeats)}
    line = {
        "benchmark": "batch_invariance",
        "smoke": args.smoke,
        "gen_ratio": max(r["generator"]["ratio"] for r in results.values()),
        "train_ratio": max(r["trainer"]["ratio"] for r in results.values()),
        "target": 1.5,
        "models": results,
        "threads": 1,
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "cpu_flags": isa_flags(),
    }
    text = json.dumps(line)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
