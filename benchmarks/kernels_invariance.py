"""Cost of the batch-invariant CPU kernels (titanrl.kernels, torch backend) vs library ops.

    .venv/bin/python benchmarks/kernels_invariance.py                 # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/kernels_invariance.py --quick         # fewer repeats
    .venv/bin/python benchmarks/kernels_invariance.py --smoke         # the tiny model, one call per arm: checks it runs
    .venv/bin/python benchmarks/kernels_invariance.py --out benchmarks/results/kernels_invariance/kernels_invariance.json

For each op and shape of the demo models (the tiny Qwen3: hidden 128, intermediate 384, 4/2
heads of 32, vocab 512; the 25M one of benchmarks/rollout_engine.py: hidden 512, intermediate
1536, 8/4 heads of 64) it times the invariant op and the op the model uses today, side by side
in one process: after a warm-up the two arms alternate (library, ours, ours, library, ...) so
machine load hits both alike. Each timed call is a loop of calls lasting >= ~20 ms. Prints one
JSON line per (op, case) with both medians (ms per call) and `slowdown` = median(ours) /
median(library), then one summary line with the worst slowdown per op.

Cases cover a training batch (64 sequences x 64 tokens = 4096 rows, forward and
forward+backward; attention also at 4 x 512 and 1 x 2048 tokens), a decode step of 64 sequences (64 rows), and one sequence's decode (1 row).
OMP_NUM_THREADS=1 by default (the project's setting on shared cores); --threads changes it.
"""

from __future__ import annotations

import os
import sys

if "--threads" in sys.argv:
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanrl.kernels.rotary import apply_rotary  # noqa: E402
from titanrl.kernels.swiglu import silu_gate  # noqa: E402
from titanrl.kernels.cpu_attention import attention  # noqa: E402
from titanrl.kernels.torch_linear import linear  # noqa: E402
from titanrl.kernels.torch_logprobs import token_logprobs  # noqa: E402
from titanrl.kernels.torch_rms_norm import rms_norm  # noqa: E402
from titanrl.models import qwen3  # noqa: E402
from titanrl.trainer import grpo  # noqa: E402

MODELS = {
    "tiny": dict(hidden=128, inter=384, heads=4, kv_heads=2, head_dim=32, vocab=512),
    "25M": dict(hidden=512, inter=1536, heads=8, kv_heads=4, head_dim=64, vocab=512),
}
ROWS = {"train": (64, 64), "decode64": (64, 1), "decode1": (1, 1)}
"""Case name -> (sequences, tokens per sequence)."""
LONG = [(4, 512), (1, 2048)]
"""(sequences, tokens) of the long-sequence attention cases."""


def _time_call(fn: Callable[[], object], min_s: float) -> float:
    """Seconds per call of fn, timing a loop long enough to be measurable."""
    n, t0 = 1, time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    n = max(1, int(min_s / max(once, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(
    op: str, case: str, lib: Callable[[], object], ours: Callable[[], object], repeats: int, min_s: float
) -> dict:
    """Interleaved medians of the two arms; returns the JSON record."""
    lib(), ours()  # warm-up (allocator, MKL packing)
    t_lib, t_ours = [], []
    for i in range(repeats):
        arms = [(lib, t_lib), (ours, t_ours)] if i % 2 == 0 else [(ours, t_ours), (lib, t_lib)]
        for fn, out in arms:
            out.append(_time_call(fn, min_s))
    ml, mo = statistics.median(t_lib), statistics.median(t_ours)
    return dict(op=op, case=case, library_ms=round(ml * 1e3, 4), invariant_ms=round(mo * 1e3, 4),
                slowdown=round(mo / ml, 3))


def _fwd_bwd(fn: Callable, *inputs: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        ins = [t.detach().requires_grad_(True) for t in inputs]
        fn(*ins).sum().backward()

    return run


def cases(model: str, spec: dict, long: list[tuple[int, int]] = LONG) -> list[tuple[str, str, Callable, Callable]]:
    """(op, case, library fn, invariant fn) for one model size."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    h, inter, H, Hkv, D, V = (spec[k] for k in ("hidden", "inter", "heads", "kv_heads", "head_dim", "vocab"))
    out: list[tuple[str, str, Callable, Callable]] = []
    Wq, Wup, Wdown, Wlm = r(H * D, h) * 0.05, r(inter, h) * 0.05, r(h, inter) * 0.05, r(V, h) * 0.05
    norm_w = torch.ones(h)
    rope = qwen3.RotaryEmbedding(D, 1e6)
    sdpa = qwen3.CausalSDPA(H, Hkv, D)
    for case, (B, T) in ROWS.items():
        N = B * T
        x = r(B, T, h)
        tag = f"{model}/{case}"
        for name, W in (("q_proj", Wq), ("up_proj", Wup), ("down_proj", Wdown), ("lm_head", Wlm)):
            xin = r(B, T, W.shape[1])
            out.append(("linear", f"{tag}/{name}", lambda xin=xin, W=W: F.linear(xin, W),
                        lambda xin=xin, W=W: linear(xin, W)))
        norm = qwen3.RMSNorm(h, 1e-6)
        out.append(("rms_norm", tag, lambda x=x: norm(x), lambda x=x: rms_norm(x, norm_w, 1e-6)))
        g, u = r(B, T, inter), r(B, T, inter)
        out.append(("silu_gate", tag, lambda g=g, u=u: F.silu(g) * u, lambda g=g, u=u: silu_gate(g, u)))
        qh = r(B, T, H, D)
        cos, sin = rope(torch.arange(T).expand(B, T), torch.float32)
        out.append(("rotary", tag, lambda qh=qh, c=cos, s=sin: qwen3.apply_rotary(qh, c, s),
                    lambda qh=qh, c=cos, s=sin: apply_rotary(qh, c, s)))
        logits, targets = r(B, T, V) * 3, torch.randint(V, (B, T), generator=gen)
        out.append(("token_logprobs", tag, lambda lg=logits, t=targets: grpo.token_logprobs(lg, t, 0.7),
                    lambda lg=logits, t=targets: token_logprobs(lg, t, 0.7)))
        if case == "train":
            q, k, v = r(B, T, H, D), r(B, T, Hkv, D), r(B, T, Hkv, D)
            out.append(("attention", f"{tag}/forward", lambda q=q, k=k, v=v: sdpa(q, k, v),
                        lambda q=q, k=k, v=v: attention(q, k, v)))
            out.append(("attention", f"{tag}/fwd+bwd", _fwd_bwd(sdpa, q, k, v), _fwd_bwd(attention, q, k, v)))
            # Long sequences: the fixed-order kernel against SDPA's GEMMs where attention dominates.
            for Bl, Tl in long:
                ql, kl, vl = r(Bl, Tl, H, D), r(Bl, Tl, Hkv, D), r(Bl, Tl, Hkv, D)
                out.append(("attention", f"{model}/long{Bl}x{Tl}/forward", lambda q=ql, k=kl, v=vl: sdpa(q, k, v),
                            lambda q=ql, k=kl, v=vl: attention(q, k, v)))
                out.append(("attention", f"{model}/long{Bl}x{Tl}/fwd+bwd", _fwd_bwd(sdpa, ql, kl, vl),
                            _fwd_bwd(attention, ql, kl, vl)))
            xin = r(B, T, h)
            out.append(("linear", f"{tag}/up_proj/fwd+bwd", _fwd_bwd(lambda x, w: F.linear(x, w), xin, Wup),
                        _fwd_bwd(linear, xin, Wup)))
        else:
            # Decode over a KV cache of 128 tokens per sequence (the library arm: SDPA, no mask).
            L = 128
            q, k, v = r(B, 1, H, D), r(B, L, Hkv, D), r(B, L, Hkv, D)
            ke, ve = (t.transpose(1, 2).repeat_interleave(H // Hkv, 1) for t in (k, v))

            def lib(q=q, ke=ke, ve=ve):
                return F.scaled_dot_product_attention(q.transpose(1, 2), ke, ve)

            out.append(("attention", f"{tag}/cache{L}", lib, lambda q=q, k=k, v=v: attention(q, k, v, q_start=L - 1)))
            # The same cache stored heads-first [B, Hkv, L, D]: read in place through its strides.
            kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            out.append(("attention", f"{tag}/cache{L}/heads_first", lib,
                        lambda q=q, k=kf, v=vf: attention(q, k, v, q_start=L - 1, heads_first=True)))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repeats and shorter timing loops")
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (default 1)")
    parser.add_argument("--models", default="tiny,25M", help="comma-separated subset of " + ",".join(MODELS))
    parser.add_argument("--out", type=Path, default=None, help="also write all records as a JSON list")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: the tiny model, one "
                        "call per arm, long attention at 1 x 128 tokens (numbers mean nothing)")
    args = parser.parse_args(argv)
    if args.smoke and args.out:
        parser.error("--smoke keeps no results: drop --out")
    repeats, min_s = (1, 0.0) if args.smoke else (3, 0.01) if args.quick else (7, 0.02)
    models, long = ("tiny", [(1, 128)]) if args.smoke else (args.models, LONG)
    records = []
    for model in models.split(","):
        for op, case, lib, ours in cases(model, MODELS[model], long):
            grad = "fwd+bwd" in case
            with torch.set_grad_enabled(grad):
                rec = compare(op, case, lib, ours, repeats, min_s)
            rec["threads"] = torch.get_num_threads()
            print(json.dumps(rec), flush=True)
            records.append(rec)
    worst: dict[str, float] = {}
    for rec in records:
        worst[rec["op"]] = max(worst.get(rec["op"], 0.0), rec["slowdown"])
    summary = dict(summary="worst_slowdown_per_op", **worst)
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps(records + [summary], indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
