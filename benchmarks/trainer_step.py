"""One GRPO trainer step on a device: tokens/s, the padding it computes, and MFU, padded vs packed
micro-batches vs packed with shared prompts, float32 vs bfloat16, batch-invariant off vs on.

    .venv/bin/python benchmarks/trainer_step.py [--device cpu|cuda] [--repeats 5] [--peak-tflops X]
        [--size medium|19m] [--rows 64] [--prompt-len 16] [--completion-len 32] [--lengths fixed|varied]
        [--dtypes float32,bfloat16] [--batch-invariant off,on] [--layouts padded,packed,shared]
        [--threads 1] [--compile off|on|off,on] [--cpu-matmul auto|mkl|onednn|mkl,onednn]

    # a check that it runs (the tiny model, 8 rows of 8 + 8 tokens, one repeat; the arms as chosen):
    .venv/bin/python benchmarks/trainer_step.py --smoke

    # issue 21's 19M workload (8 prompts x 8 samples, completions of up to 64 tokens):
    .venv/bin/python benchmarks/trainer_step.py --size 19m --rows 64 --prompt-len 30 --completion-len 64 \\
        --lengths varied --dtypes float32 --batch-invariant off

On a 2-core CPU a bfloat16 step is many times slower than float32 unless the CPU has AMX:
`--rows 16 --dtypes float32` keeps a CPU run to a few minutes.

Models: `medium` is the 25M-parameter model of benchmarks/batch_invariance.py (hidden 512,
8 layers, head_dim 64, 259-token byte vocabulary); `19m` the same with 6 layers (issue 21's
TRL comparison); `0.6b` Qwen3-0.6B's shape and 151,936-token vocabulary (for GPUs); `tiny` the
0.4M model of titanrl.models.tiny (`--smoke`).
One `GRPOTrainer.step` (forward, backward, clip, AdamW) on `--rows` sequences
in one micro-batch. `--lengths fixed`: every prompt `--prompt-len` and every completion
`--completion-len` tokens (a random-init policy rarely stops early); `varied`: per group a
prompt of `prompt-len/2 .. prompt-len` tokens, per sample a completion of `4 .. completion-len`
(uniform), as a policy that has learnt to stop writes them. Every arm runs in the same process
and is timed in alternating order after one warm-up step, so load from other processes hits
the arms alike.

Layouts: `padded` (`train.compute.pack_sequences` off) is the trainer before packing (today's settings
for pp/cp/XLA layouts): each sample a row, right-padded to the micro-batch's longest; `packed`
packs the real tokens into one row (`share_prompts` off); `shared` also computes each group's
prompt once (`share_prompts`, the default). Per arm: step_s (median), tokens_per_s (real
tokens: up to each row's last trained target, per second), computed_tokens (tokens that went
through the model in the last step, counted at the embedding), pad_fraction (the computed token
slots that are padding), speedup_vs_padded (the same dtype and mode, padded, over this arm),
vs_float32_off (step time over float32 padded, batch invariance off, eager), speedup_vs_eager
(`--compile on` arms: the same arm eager over this one), speedup_vs_first_cpu_matmul (`--cpu-matmul
mkl,onednn`: the same arm with the first library listed over this one), warmup_s (the first step: compile
time included). FLOPs
count useful work only: 6 x (matmul parameters) x real tokens + 6 x layers x heads x head_dim x
sum of each sequence's length^2 (causal attention, forward + backward); MFU = achieved FLOP/s /
peak where the peak is known (`--peak-tflops`, or the table below for GPUs; none for CPUs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from titanrl.trainer.setup import TrainerSetup

SIZES = {
    "medium": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, intermediate_size=1536),
    "19m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                head_dim=64, intermediate_size=1536),
    "tiny": {},  # titanrl.models.tiny's defaults (hidden 128, 2 layers): --smoke
    # Qwen3-0.6B's shape with its real 151,936-row vocabulary (the byte tokenizer's ids are a
    # subset): a GPU size, where the LM head and chunked logprobs carry real weight.
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960),
}
PEAK_TFLOPS = {  # dense, per GPU, from the vendors' data sheets (SXM parts)
    "H200": {"float32": 67.0, "bfloat16": 989.0},
    "H100": {"float32": 67.0, "bfloat16": 989.0},
    "A100": {"float32": 19.5, "bfloat16": 312.0},
}


LAYOUTS = {
    "padded": dict(pack_sequences=False),
    "packed": dict(pack_sequences=True, share_prompts=False),
    "shared": dict(pack_sequences=True, share_prompts=True),
}
"""The `train.compute` settings of each `--layouts` arm."""


def _groups(rows: int, prompt_len: int, completion_len: int, varied: bool):
    from titanrl.types import Group, Sample

    rng = random.Random(0)
    groups = []
    for gid in range(rows // 8):
        p = rng.randint(max(1, prompt_len // 2), prompt_len) if varied else prompt_len
        prompt = [rng.randrange(256) for _ in range(p)]
        samples = []
        for k in range(8):
            c = rng.randint(min(4, completion_len), completion_len) if varied else completion_len
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt,
                                  completion_ids=[rng.randrange(256) for _ in range(c)],
                                  gen_logprobs=[-5.5] * c, reward=float(k % 3), group_id=gid, policy_version=0))
        groups.append(Group(samples))
    return groups


def _flops_per_step(model: torch.nn.Module, config, lengths: list[int]) -> float:
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if config.tie_word_embeddings:  # the tied head is a matmul too
        matmul_params += model.model.embed_tokens.weight.numel()
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * sum(n * n for n in lengths)
    return 6 * matmul_params * sum(lengths) + attention


def _peak(device: str, dtype: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peaks in PEAK_TFLOPS.items():
            if key in name:
                return peaks[dtype] * 1e12
    return None


def _flags(value: str) -> list[bool]:
    return [{"off": False, "on": True}[v] for v in value.split(",")]


def main() -> None:
    from titanrl.config import ComputeConfig, MemoryConfig, ModelConfig, TrainConfig
    from titanrl.kernels.cpu_build import isa_flags
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.moe import real_tokens
    from titanrl.trainer.packing import pad_fraction
    from titanrl.trainer.trainer import GRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak of the device, to report MFU")
    parser.add_argument("--threads", type=int, default=int(os.environ["OMP_NUM_THREADS"]))
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--rows", type=int, default=64, help="sequences per step (a multiple of 8)")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--lengths", choices=["fixed", "varied"], default="fixed")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated parameter dtypes")
    parser.add_argument("--batch-invariant", default="off,on", help="off, on or off,on")
    parser.add_argument(
        "--compile",
        default="off",
        help="train.compute.compile: off, on or off,on (batch-invariant arms stay eager: compile refuses them)",
    )
    parser.add_argument("--cpu-matmul", default="auto", help="train.compute.cpu_matmul arms: auto, mkl, onednn or a "
                        "comma-separated list (mkl,onednn: side by side)")
    parser.add_argument("--layouts", default="padded,packed,shared",
                        help="comma-separated arms: padded (pack_sequences off), packed (share_prompts off), shared")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: --size tiny --rows 8 "
                        "--prompt-len 8 --completion-len 8 --repeats 1, the arms as chosen (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps no results: drop --out")
        args.size, args.rows, args.prompt_len, args.completion_len, args.repeats = "tiny", 8, 8, 8, 1
    if args.rows % 8:
        parser.error(f"--rows must be a multiple of 8 (groups of 8), got {args.rows}")

    strict_mkl = False
    if True in _flags(args.batch_invariant):
        from titanrl.kernels.mkl_mode import ensure_strict_mkl, needs_strict_mkl

        # Batch-invariant arms on an AVX-512 CPU need MKL's strict AVX2 mode, set before the first
        # GEMM and for the whole process: the other arms then run on that path too (the summary says so).
        strict_mkl = needs_strict_mkl()
        ensure_strict_mkl()
    layouts = args.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        parser.error(f"--layouts: unknown {sorted(unknown)}; choose from {list(LAYOUTS)}")
    arms = [(dtype, bi, layout, compiled, matmul) for dtype in args.dtypes.split(",")
            for bi in _flags(args.batch_invariant) for layout in layouts for compiled in _flags(args.compile)
            for matmul in args.cpu_matmul.split(",") if not (bi and compiled) and not (bi and matmul == "onednn")]
    groups = _groups(args.rows, args.prompt_len, args.completion_len, args.lengths == "varied")
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / args.size, seed=0, **SIZES[args.size])
        trainers, errors, computed = {}, {}, {}
        warmup_s = {}
        for arm in arms:
            dtype, bi, layout, compiled, matmul = arm
            try:
                tr = GRPOTrainer(
                    TrainerSetup(
                        ModelConfig(checkpoint=str(ckpt), dtype=dtype),
                        TrainConfig(
                            compute=ComputeConfig(
                                device=args.device, threads=args.threads, compile=compiled, cpu_matmul=matmul,
                                **LAYOUTS[layout],
                            ),
                            memory=MemoryConfig(micro_batch_size=args.rows),
                        ),
                        temperature=1.0,
                        seed=0,
                        batch_invariant=bi,
                    )
                )
                t0 = time.perf_counter()
                tr.step(groups)  # warm-up (kernel builds, allocator, autotuning, torch.compile)
                warmup_s[arm] = time.perf_counter() - t0
                trainers[arm] = tr
            except Exception as e:  # an arm this device cannot run is reported, not fatal
                errors[arm] = f"{type(e).__name__}: {e}"[:300]
        times: dict[tuple, list[float]] = {arm: [] for arm in trainers}
        order = list(trainers)
        for r in range(args.repeats):
            for arm in (order if r % 2 == 0 else order[::-1]):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                counted: list[int] = []
                hook = trainers[arm].model.model.embed_tokens.register_forward_hook(
                    lambda m, i, o, counted=counted: counted.append(i[0].numel()))
                t0 = time.perf_counter()
                trainers[arm].step(groups)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times[arm].append(time.perf_counter() - t0)
                hook.remove()
                computed[arm] = sum(counted)
        mask = next(iter(trainers.values())).prepare_batch(groups).loss_mask_BT if trainers else None
        lengths = real_tokens(mask).sum(1).tolist() if mask is not None else []
        padded_fraction = pad_fraction(mask, args.rows) if mask is not None else None
        median = {arm: statistics.median(t) for arm, t in times.items()}
        first_matmul = args.cpu_matmul.split(",")[0]
        base = median.get(("float32", False, "padded", False, first_matmul))
        for arm in arms:
            dtype, bi, layout, compiled, matmul = arm
            line = {"benchmark": "trainer_step", "device": args.device, "dtype": dtype, "batch_invariant": bi,
                    "layout": layout, "compile": compiled, "cpu_matmul": matmul}
            if arm in errors:
                line["error"] = errors[arm]
            else:
                tr, step_s = trainers[arm], median[arm]
                flops = _flops_per_step(tr.model, tr.model_config, lengths)
                peak = _peak(args.device, dtype, args.peak_tflops)
                padded = median.get((dtype, bi, "padded", compiled, matmul))
                eager = median.get((dtype, bi, layout, False, matmul)) if compiled else None
                first = median.get((dtype, bi, layout, compiled, first_matmul)) if matmul != first_matmul else None
                line.update(step_s=round(step_s, 4), tokens_per_s=round(sum(lengths) / step_s, 1),
                            computed_tokens=computed[arm],
                            pad_fraction=round(padded_fraction, 4) if layout == "padded" else 0.0,
                            speedup_vs_padded=round(padded / step_s, 3) if padded else None,
                            speedup_vs_eager=round(eager / step_s, 3) if eager else None,
                            speedup_vs_first_cpu_matmul=round(first / step_s, 3) if first else None,
                            warmup_s=round(warmup_s[arm], 2),
                            tflops=round(flops / step_s / 1e12, 4),
                            mfu=round(flops / step_s / peak, 4) if peak else None,
                            vs_float32_off=round(step_s / base, 3) if base else None)
            lines.append(line)
    host = {"benchmark": "trainer_step", "summary": True, "smoke": args.smoke, "device": args.device,
            "threads": args.threads,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "cpu_flags": isa_flags(),
            "size": args.size, "rows": args.rows, "lengths": args.lengths, "prompt_len": args.prompt_len,
            "completion_len": args.completion_len, "real_tokens": int(sum(lengths)),
            "padded_pad_fraction": None if padded_fraction is None else round(padded_fraction, 4),
            "mkl_strict_avx2": strict_mkl, "repeats": args.repeats, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    lines.append(host)
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
