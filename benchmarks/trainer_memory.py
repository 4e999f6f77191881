"""Peak memory and tokens/s of one GRPO step at Qwen3-0.6B's shape, each memory switch off and on.

    .venv/bin/python benchmarks/trainer_memory.py [--layers 2] [--rows 16] [--completion 128]
        [--out benchmarks/results/trainer_memory_cpu.jsonl]

The model is Qwen3-0.6B's published architecture (151,936-token vocabulary, hidden 1024, 16 query
/ 8 KV heads of 128, SwiGLU 3072, tied embeddings) at reduced depth (`--layers`, 28 in the real
model), randomly initialised. One step is `GRPOTrainer.step` on `--rows` sequences of 16 prompt +
`--completion` completion tokens in one micro-batch: forward, backward, clip, AdamW.

Each arm runs in its own process, so its peak resident memory (getrusage) is its own: the process
builds the trainer, takes one step (AdamW allocates its state), then a second, timed step. The
headline ratios compare arms measured by the same script on the same machine:
  chunked_logprobs_peak_ratio: peak with full logits / peak with chunked logprobs;
  activation_checkpointing_peak_ratio: peak with stored activations / with every block checkpointed.
Each arm's line also carries the `titanrl plan` estimate of the same step (`estimate_gib`) and
its error against the measurement.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

QWEN3_0_6B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960, tie_word_embeddings=True,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6)
PROMPT_LEN = 16

ARMS: dict[str, dict] = {
    # name -> TrainConfig overrides (filled in below, once the switches exist)
}
