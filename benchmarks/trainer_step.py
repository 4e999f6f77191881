"""One GRPO trainer step on a device: tokens/s and MFU, float32 vs bfloat16, batch-invariant off vs on.

    .venv/bin/python benchmarks/trainer_step.py [--device cpu|cuda] [--repeats 5] [--peak-tflops X]
        [--rows 64] [--dtypes float32,bfloat16]

On a 2-core CPU a bfloat16 step is many times slower than float32 (no bf16 units):
`--rows 16 --dtypes float32` keeps a CPU run to a few minutes.

The 25M-parameter model of benchmarks/batch_invariance.py (hidden 512, 8 layers, head_dim 64,
256-token vocabulary), one `GRPOTrainer.step` (forward, backward, clip, AdamW) on 64 sequences of
16 prompt + 32 completion tokens, every arm in the same process: the arms are timed in
alternating order after one warm-up step each, so load from other processes hits them alike.

Prints one JSON line per arm and a summary line with each arm's time relative to float32 with
batch invariance off (the baseline, measured in the same run). FLOPs per step are counted as
6 x (matmul parameters) x tokens + 6 x layers x heads x head_dim x T^2 x rows (causal attention,
forward + backward); MFU = achieved FLOP/s / peak, where the peak is known (`--peak-tflops`,
or the table below for GPUs; none for CPUs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

MEDIUM = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              intermediate_size=1536)
ROWS, PROMPT_LEN, COMPLETION_LEN = 64, 16, 32
PEAK_TFLOPS = {  # dense, per GPU, from the vendors' data sheets (SXM parts)
    "H200": {"float32": 67.0, "bfloat16": 989.0},
    "H100": {"float32": 67.0, "bfloat16": 989.0},
    "A100": {"float32": 19.5, "bfloat16": 312.0},
}


def _groups(rows: int):
    from titanrl.types import Group, Sample

    g = torch.Generator().manual_seed(0)
    groups = []
    for gid in range(rows // 8):
        samples = []
        for k in range(8):
            prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist()
            completion = torch.randint(0, 256, (COMPLETION_LEN,), generator=g).tolist()
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=[-5.5] * COMPLETION_LEN, reward=float(k % 3), group_id=gid,
                                  policy_version=0))
        groups.append(Group(samples))
    return groups


def _flops_per_step(model: torch.nn.Module, config, rows: int) -> float:
    T = PROMPT_LEN + COMPLETION_LEN - 1
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if config.tie_word_embeddings:  # the tied head is a matmul too
        matmul_params += model.model.embed_tokens.weight.numel()
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * T * T * rows
    return 6 * matmul_params * rows * T + attention


def _peak(device: str, dtype: str, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peaks in PEAK_TFLOPS.items():
            if key in name:
                return peaks[dtype] * 1e12
    return None


def _cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()
    return " ".join(f for f in flags.split() if f.startswith(("avx", "amx", "fma")))


def main() -> None:
    from titanrl.config import ModelConfig, TrainConfig
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer import GRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak of the device, to report MFU")
    parser.add_argument("--threads", type=int, default=int(os.environ["OMP_NUM_THREADS"]))
    parser.add_argument("--rows", type=int, default=ROWS, help="sequences per step (a multiple of 8)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated parameter dtypes")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    args = parser.parse_args()

    arms = [(dtype, bi) for dtype in args.dtypes.split(",") for bi in (False, True)]
    groups = _groups(args.rows)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "medium", seed=0, **MEDIUM)
        trainers, errors = {}, {}
        for dtype, bi in arms:
            try:
                tr = GRPOTrainer(ModelConfig(checkpoint=str(ckpt), dtype=dtype),
                                 TrainConfig(device=args.device, threads=args.threads, micro_batch_size=args.rows),
                                 temperature=1.0, seed=0, batch_invariant=bi)
                tr.step(groups)  # warm-up (kernel builds, allocator, autotuning)
                trainers[(dtype, bi)] = tr
            except Exception as e:  # an arm this device cannot run is reported, not fatal
                errors[(dtype, bi)] = f"{type(e).__name__}: {e}"[:300]
        times: dict[tuple, list[float]] = {arm: [] for arm in trainers}
        order = list(trainers)
        for r in range(args.repeats):
            for arm in (order if r % 2 == 0 else order[::-1]):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                trainers[arm].step(groups)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times[arm].append(time.perf_counter() - t0)
        base = statistics.median(times[("float32", False)]) if ("float32", False) in times else None
        for dtype, bi in arms:
            line = {"benchmark": "trainer_step", "device": args.device, "dtype": dtype, "batch_invariant": bi}
            if (dtype, bi) in errors:
                line["error"] = errors[(dtype, bi)]
            else:
                tr = trainers[(dtype, bi)]
                step_s = statistics.median(times[(dtype, bi)])
                flops = _flops_per_step(tr.model, tr.model_config, args.rows)
                peak = _peak(args.device, dtype, args.peak_tflops)
                tokens = args.rows * (PROMPT_LEN + COMPLETION_LEN - 1)
                line.update(step_s=round(step_s, 4), tokens_per_s=round(tokens / step_s, 1),
                            tflops=round(flops / step_s / 1e12, 4),
                            mfu=round(flops / step_s / peak, 4) if peak else None,
                            vs_float32_off=round(step_s / base, 3) if base else None)
            lines.append(line)
    host = {"benchmark": "trainer_step", "summary": True, "device": args.device, "threads": args.threads,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "cpu_flags": _cpu_flags(), "rows": args.rows, "seq_len": PROMPT_LEN + COMPLETION_LEN - 1,
            "repeats": args.repeats}
    lines.append(host)
    for line in lines:
        print(json.dumps(line), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
