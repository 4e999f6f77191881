"""`titanrl plan`'s single-process CPU estimate against the measured peak RSS of the same step.

    .venv/bin/python benchmarks/plan_check.py [--shapes 2x4x256,4x2x512,2x8x64,6x1x256]

Each shape LAYERSxROWSxTOKENS is Qwen3-0.6B's published config (examples/configs/qwen3-0.6b.json,
full 151,936 vocabulary, tied) at reduced depth, float32, with full (unchunked) logits: the
trainer's current logprob path. Each runs in a fresh process (peak RSS is per process): build
the model, two steps of forward, `token_logprobs`, backward, AdamW, zero_grad; then the peak RSS
(`ru_maxrss`) is compared with `estimate_cpu_process` (which includes the measured baseline of
a process that imported torch and the trainer). One JSON line per shape, then a summary line.
`benchmarks/trainer_memory.py` does the same through the real GRPO trainer with each switch.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen3-0.6b.json"


def one_shape(layers: int, rows: int, tokens: int) -> dict:
    import resource

    import torch

    import titanrl.trainer.trainer  # noqa: F401  (part of the baseline the estimate counts)
    from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
    from titanrl.planning import ModelShape, Workload, estimate_cpu_process
    from titanrl.trainer.grpo import token_logprobs

    torch.set_num_threads(1)
    hf = {**json.loads(CONFIG.read_text()), "num_hidden_layers": layers}
    model = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(hf))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, hf["vocab_size"], (rows, tokens), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        (-token_logprobs(model(ids), ids).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    work = Workload(seq_len=tokens, batch=rows, micro_batch=rows, logprob_chunk_tokens=0)
    est = estimate_cpu_process(ModelShape.from_hf_dict(hf), work)
    terms = {k: v for k, v in est.as_dict().items() if isinstance(v, int) and not isinstance(v, bool)}
    return dict(layers=layers, rows=rows, tokens=tokens, measured_peak_rss=measured, estimated_peak=est.peak,
                ratio=round(est.peak / measured, 3), terms=terms)


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()
    return " ".join(f for f in flags.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2x4x256,4x2x512,2x8x64,6x1x256")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_shape(*(int(x) for x in args.one.split("x")))))
        return
    ratios = []
    for shape in args.shapes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", shape], check=True, capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["cpu_flags"] = cpu_flags()
        ratios.append(row["ratio"])
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": "estimate / measured peak RSS", "min_ratio": min(ratios), "max_ratio": max(ratios)}))


if __name__ == "__main__":
    main()
