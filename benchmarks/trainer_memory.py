"""Peak memory and tokens/s of one GRPO step at Qwen3-0.6B's shape, each memory switch off and on.

    .venv/bin/python benchmarks/trainer_memory.py [--layers 2] [--rows 16] [--completion 128]
        [--config-json examples/configs/smollm2-135m.json] [--out benchmarks/results/trainer_memory/trainer_memory_cpu.jsonl]
    .venv/bin/python benchmarks/trainer_memory.py --smoke   # a 1M Qwen3, 4 rows, 3 arms: checks it runs

`--config-json` measures another published architecture of any family instead (its depth cut to
`--layers` unless that is 0, which keeps the published depth).

The model is Qwen3-0.6B's published architecture (151,936-token vocabulary, hidden 1024, 16 query
/ 8 KV heads of 128, SwiGLU 3072, tied embeddings) at reduced depth (`--layers`, 28 in the real
model), randomly initialised. One step is `GRPOTrainer.step` on `--rows` sequences of 16 prompt +
`--completion` completion tokens in one micro-batch: forward, backward, clip, AdamW.

Each arm runs in its own process, so its peak resident memory (getrusage) is its own: the process
builds the trainer, takes one step (AdamW allocates its state), then a second, timed step. The
headline ratios compare arms measured by the same script on the same machine:
  chunked_logprobs_peak_ratio: peak with full logits / peak with chunked logprobs;
  activation_checkpointing_peak_ratio: peak with stored activations / with every block checkpointed;
  heap_mmap_threshold_peak_ratio, _step_time_ratio: glibc's default heap / the trainer's 4 MiB
  mmap threshold (train.memory.heap_mmap_threshold_mib), both with every block checkpointed;
  heap_16mib_peak_ratio, _step_time_ratio: the same for a 16 MiB threshold.
Each arm's line also carries the `titanrl plan` estimate of the same step (`estimate_gib`) and
its error against the measurement.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from titanrl.config import MemoryConfig  # noqa: E402
from titanrl.trainer.setup import TrainerSetup  # noqa: E402

QWEN3_0_6B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960, tie_word_embeddings=True,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6)
SMOKE_SHAPE = {**QWEN3_0_6B, **dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, max_position_embeddings=512)}
"""`--smoke`: Qwen3-0.6B's architecture at a size that takes a second a step (the real run's arms)."""
PROMPT_LEN = 16

ARMS: dict[str, dict] = {
    # name -> TrainConfig overrides. "Full logits" is one chunk holding every token of the step.
    "full_logits": dict(memory=MemoryConfig(logprob_chunk_tokens=1 << 30)),
    "chunked": dict(),  # the default chunk (train.memory.logprob_chunk_tokens)
    "chunked+checkpointing": dict(memory=MemoryConfig(activation_checkpointing="full")),
    "full_logits+checkpointing": dict(
        memory=MemoryConfig(logprob_chunk_tokens=1 << 30, activation_checkpointing="full")
    ),
    # glibc's own heap behaviour (train.memory.heap_mmap_threshold_mib=0): freed tensors stay resident.
    "chunked+checkpointing+glibc_heap": dict(
        memory=MemoryConfig(activation_checkpointing="full", heap_mmap_threshold_mib=0)
    ),
    # A 16 MiB threshold: smaller tensors reuse the heap's pages instead of faulting fresh ones.
    "chunked+checkpointing+heap_16mib": dict(
        memory=MemoryConfig(activation_checkpointing="full", heap_mmap_threshold_mib=16)
    ),
    # Micro-batches of 4 sequences (what the memory plan picks for Qwen3-0.6B on a 24 GB machine):
    # each one's activations are allocated and freed again, which fragments the heap below the
    # mmap threshold (hidden-size activations of 4 x 144 tokens are 2.25 MiB).
    "micro_batches": dict(memory=MemoryConfig(micro_batch_size=4, activation_checkpointing="none")),
    "micro_batches+heap_1mib": dict(
        memory=MemoryConfig(micro_batch_size=4, activation_checkpointing="none", heap_mmap_threshold_mib=1)
    ),
}


def _groups(rows: int, completion: int, vocab: int):
    import torch

    from titanrl.types import Group, Sample

    g = torch.Generator().manual_seed(0)
    groups = []
    for gid in range(rows // 4):
        samples = []
        for k in range(4):
            prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist()
            tokens = torch.randint(0, vocab, (completion,), generator=g).tolist()
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=tokens,
                                  gen_logprobs=[-12.0] * completion, reward=float(k % 2), group_id=gid,
                                  policy_version=0))
        groups.append(Group(samples))
    return groups


def run_arm(ckpt: str, overrides: dict, rows: int, completion: int, threads: int) -> dict:
    """In this (fresh) process: build the trainer, one step, one timed step; peak RSS."""
    import torch

    from titanrl.config import ComputeConfig, MemoryConfig, ModelConfig, TrainConfig
    from titanrl.memory import current_rss_bytes, peak_rss_bytes
    from titanrl.trainer.trainer import GRPOTrainer

    memory = dataclasses.replace(overrides.get("memory", MemoryConfig()), micro_batch_size=rows)
    train = TrainConfig(compute=ComputeConfig(threads=threads, device="cpu"), memory=memory)
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=ckpt), train, temperature=1.0, seed=0))
    after_load = current_rss_bytes()
    groups = _groups(rows, completion, trainer.model_config.vocab_size)
    trainer.step(groups)
    t0 = time.perf_counter()
    metrics = trainer.step(groups)
    step_s = time.perf_counter() - t0
    tokens = rows * (PROMPT_LEN + completion - 1)
    return dict(
        peak_rss_bytes=peak_rss_bytes(),
        rss_after_load_bytes=after_load,
        step_s=round(step_s, 3),
        tokens_per_s=round(tokens / step_s, 1),
        loss=metrics["loss"],
        torch=torch.__version__,
    )


def settings(overrides: dict) -> dict:
    """An arm's TrainConfig overrides as JSON: the fields each section sets away from its default,
    by field name (`{"activation_checkpointing": "full"}`, as the result files have them)."""
    return {f.name: getattr(section, f.name) for section in overrides.values() for f in dataclasses.fields(section)
            if getattr(section, f.name) != getattr(type(section)(), f.name)}


def estimate(ckpt: str, overrides: dict, rows: int, completion: int) -> int:
    """`titanrl plan`'s estimate of the same single-process step (bytes)."""
    from titanrl.config import TrainConfig
    from titanrl.planning import ModelShape, Workload, estimate_cpu_process

    from titanrl.config.unplanned import concrete_memory

    memory = concrete_memory(TrainConfig(**overrides).memory)  # what the trainer runs ('auto': unplanned)
    train = TrainConfig(**overrides)
    work = Workload(seq_len=PROMPT_LEN + completion - 1, batch=rows, micro_batch=min(rows, int(memory.micro_batch_size)),
                    dtype="float32", compute_dtype="float32", activation_checkpointing=memory.activation_checkpointing,
                    logprob_chunk_tokens=train.memory.logprob_chunk_tokens)  # None: the trainer's default rule
    return estimate_cpu_process(ModelShape.from_config_json(Path(ckpt) / "config.json"), work).peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (Qwen3-0.6B has 28)")
    parser.add_argument("--rows", type=int, default=16, help="sequences per step (a multiple of 4)")
    parser.add_argument("--completion", type=int, default=128, help="completion tokens per sequence")
    parser.add_argument("--threads", type=int, default=int(os.environ["OMP_NUM_THREADS"]))
    parser.add_argument(
        "--arms",
        default=None,
        help="comma-separated subset of: " + ", ".join(ARMS) + " (default: all; "
        "--smoke: full_logits, chunked and chunked+checkpointing+glibc_heap, every setting an arm changes)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--config-json", type=Path, default=None,
                        help="an HF config.json of any family (default: Qwen3-0.6B's architecture)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a check that the script runs: SMOKE_SHAPE's "
        "2 layers, --rows 4 --completion 16, 3 arms (~5 s each: a process of its own; numbers mean nothing)",
    )
    parser.add_argument("--child", nargs=2, metavar=("CKPT", "ARM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke and not args.child:
        if args.out or args.config_json:
            parser.error("--smoke measures SMOKE_SHAPE and keeps no results: drop --out and --config-json")
        args.layers, args.rows, args.completion = 2, 4, 16
        args.arms = args.arms or "full_logits,chunked,chunked+checkpointing+glibc_heap"
    args.arms = args.arms or ",".join(ARMS)
    if args.child:
        ckpt, arm = args.child
        print(json.dumps(run_arm(ckpt, ARMS[arm], args.rows, args.completion, args.threads)))
        return

    from titanrl.kernels.cpu_build import isa_flags

    from titanrl.models.qwen3 import Qwen3Config
    from titanrl.models.tiny import config_from_hf_json, write_checkpoint

    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.config_json is None:
            hf = Qwen3Config(num_hidden_layers=args.layers, **(SMOKE_SHAPE if args.smoke else QWEN3_0_6B)).to_hf_dict()
        else:
            hf = json.loads(args.config_json.read_text())
            if args.layers:
                hf["num_hidden_layers"] = args.layers
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        ckpt = str(write_checkpoint(Path(tmp) / "ckpt", config_from_hf_json(Path(tmp) / "config.json")))
        for arm in args.arms.split(","):
            cmd = [sys.executable, __file__, "--child", ckpt, arm, "--rows", str(args.rows),
                   "--completion", str(args.completion), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = {"benchmark": "trainer_memory", "arm": arm, "layers": hf["num_hidden_layers"], "rows": args.rows,
                    "seq_len": PROMPT_LEN + args.completion - 1, **settings(ARMS[arm])}
            if out.returncode != 0:
                line["error"] = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
            else:
                line.update(json.loads(out.stdout.strip().splitlines()[-1]))
                line["peak_rss_gib"] = round(line["peak_rss_bytes"] / 2**30, 3)
                est = estimate(ckpt, ARMS[arm], args.rows, args.completion)
                line.update(estimate_gib=round(est / 2**30, 3), estimate_over_measured=round(est / line["peak_rss_bytes"], 3))
            lines.append(line)
            print(json.dumps(line), flush=True)
    peak = {line["arm"]: line.get("peak_rss_bytes") for line in lines}
    step_s = {line["arm"]: line.get("step_s") for line in lines}

    def ratio(a: str, b: str, of: dict = peak) -> float | None:
        return round(of[a] / of[b], 3) if of.get(a) and of.get(b) else None

    summary = {"benchmark": "trainer_memory", "summary": True, "smoke": args.smoke, "layers": hf["num_hidden_layers"],
               "rows": args.rows,
               "seq_len": PROMPT_LEN + args.completion - 1, "vocab_size": hf["vocab_size"],
               "architecture": hf.get("architectures", ["Qwen3ForCausalLM"])[0],
               "threads": args.threads, "cpu_flags": isa_flags(),
               "chunked_logprobs_peak_ratio": ratio("full_logits", "chunked"),
               "activation_checkpointing_peak_ratio": ratio("chunked", "chunked+checkpointing"),
               "activation_checkpointing_peak_ratio_full_logits": ratio("full_logits", "full_logits+checkpointing"),
               "heap_mmap_threshold_peak_ratio": ratio("chunked+checkpointing+glibc_heap", "chunked+checkpointing"),
               "heap_mmap_threshold_step_time_ratio": ratio("chunked+checkpointing+glibc_heap", "chunked+checkpointing",
                                                            step_s),
               "heap_16mib_peak_ratio": ratio("chunked+checkpointing+heap_16mib", "chunked+checkpointing"),
               "heap_16mib_step_time_ratio": ratio("chunked+checkpointing+heap_16mib", "chunked+checkpointing", step_s),
               "estimate_over_measured": [line.get("estimate_over_measured") for line in lines]}
    lines.append(summary)
    print(json.dumps(summary), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
