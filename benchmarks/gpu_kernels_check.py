"""One-shot GPU check of TitanRL's Triton batch-invariant kernels: correctness, invariance, speed.

    python benchmarks/gpu_kernels_check.py                   # CUDA + Triton machine, < 4 min
    python benchmarks/gpu_kernels_check.py --smoke           # tiny shapes, Triton interpreter on CPU

Needs only torch (with CUDA) and triton; not vLLM or Ray. It loads `titanrl/kernels/` from this
checkout without running `titanrl/__init__.py`, so nothing else of TitanRL is imported.

Prints one JSON object per line and never aborts: every check or timing runs in its own
try/except and a failure prints {"name": ..., "error": ..., "traceback": ...}. Once the time
budget (--budget-s, default 200 s) is spent, the remaining items print {"skipped": ...}.

Checks (`support.kernel_checks`, the same functions the tests use): each Triton kernel
against float64 torch (`max_rel_err`) and a probe row/query bitwise equal alone vs inside
batches of other sizes at random positions (`invariant`):
- linear, float32 and bfloat16, K = N = 4096 (and 4096 x 7), M in 1..2048, input gradient too;
  `library_invariant` says whether cuBLAS's F.linear passed the same test;
- rms_norm (D = 128, 4096), log_softmax / token_logprobs (V = 512, 151,936);
- attention, float32 and bfloat16, head_dim 128, 32 query / 8 kv heads, sequences of
  2048, 1000 and 37 tokens: full forward = prefill alone = chunked prefill (512, 1000) =
  decode at random positions = batched decode;
- gradients of every kernel vs autograd through reference ops (<= 1e-5, float32).
Timings (CUDA events, median of repeats, both arms in the same process, interleaved):
invariant kernel vs the library op, printed with `slowdown` = ours / library.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T_START = time.time()


def emit(**record) -> None:
    record.setdefault("elapsed_s", round(time.time() - T_START, 1))
    print(json.dumps(record, default=str), flush=True)


def load_kernels():
    """Imports titanrl.kernels.* from this checkout without executing titanrl/__init__.py."""
    if "titanrl" not in sys.modules:
        pkg = types.ModuleType("titanrl")
        pkg.__path__ = [str(REPO / "titanrl")]
        sys.modules["titanrl"] = pkg
    import importlib

    mods = {
        name: importlib.import_module(f"titanrl.kernels.{name}")
        for name in ("triton_matmul", "triton_rms_norm", "triton_log_softmax", "triton_attention")
    }
    if str(REPO / "tests") not in sys.path:  # the checks the tests use: tests/support/kernel_checks.py
        sys.path.insert(0, str(REPO / "tests"))
    mods["checks"] = importlib.import_module("support.kernel_checks")
    return types.SimpleNamespace(**mods)


class Runner:
    """Runs named items, each isolated; stops starting new ones after the budget."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.failed = 0

    def run(self, name: str, fn: Callable[[], object]) -> None:
        if time.time() - T_START > self.budget_s:
            emit(name=name, skipped=f"time budget of {self.budget_s} s spent")
            return
        t0 = time.time()
        try:
            results = fn()
            for res in results if isinstance(results, list) else [results]:
                if isinstance(res, dict) and res.get("ok") is False:
                    self.failed += 1
                fields = res if isinstance(res, dict) else {"result": res}
                emit(name=name, seconds=round(time.time() - t0, 2), **fields)
        except Exception as exc:  # noqa: BLE001 - report and keep going
            self.failed += 1
            emit(name=name, error=repr(exc)[:2000], traceback=traceback.format_exc()[-3000:])
        finally:
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass


def timer(device: str):
    """Returns time_ms(fn): median milliseconds of one call (CUDA events on GPU)."""
    import torch

    def time_ms(fn: Callable[[], object], repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
        return out

    return time_ms


def compare(device: str, name: str, lib: Callable, ours: Callable, repeats: int) -> dict:
    """Interleaved timing of two arms after a warm-up (Triton compiles there)."""
    time_ms = timer(device)
    lib(), ours(), lib(), ours()
    t_lib, t_ours = [], []
    for i in range(repeats):
        if i % 2 == 0:
            t_lib += time_ms(lib, 1)
            t_ours += time_ms(ours, 1)
        else:
            t_ours += time_ms(ours, 1)
            t_lib += time_ms(lib, 1)
    ml, mo = statistics.median(t_lib), statistics.median(t_ours)
    return dict(timing=name, library_ms=round(ml, 4), invariant_ms=round(mo, 4), slowdown=round(mo / ml, 3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU through Triton's interpreter (TRITON_INTERPRET=1): checks "
                             "the script runs; correctness holds, timings mean nothing")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new items after this")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

    try:
        import torch
        import triton

        device = "cpu" if args.smoke else "cuda"
        env = dict(torch=torch.__version__, triton=triton.__version__, device=device)
        if device == "cuda":
            if not torch.cuda.is_available():
                emit(name="environment", error="CUDA is not available; use --smoke on a CPU machine")
                return 2
            props = torch.cuda.get_device_properties(0)
            env.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                       tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        emit(name="environment", **env)
        K = load_kernels()
    except Exception as exc:  # noqa: BLE001
        emit(name="setup", error=repr(exc), traceback=traceback.format_exc()[-3000:])
        return 2

    smoke = args.smoke
    f32, bf16 = torch.float32, torch.bfloat16
    chk, run = K.checks, Runner(args.budget_s)
    ops = dict(linear=K.triton_matmul.linear, rms_norm=K.triton_rms_norm.rms_norm,
               log_softmax=K.triton_log_softmax.log_softmax, token_logprobs=K.triton_log_softmax.token_logprobs,
               attention=K.triton_attention.attention)

    # ---------------------------------------------------------------- correctness + invariance
    Ms = [1, 2, 3, 5, 17] if smoke else [1, 2, 3, 4, 7, 16, 33, 128, 511, 2048]
    lin_cases = [(48, 40, f32, 1e-5)] if smoke else [
        (4096, 4096, f32, 2e-5), (4096, 4096, bf16, 2e-2), (4096, 7, f32, 2e-5), (1024, 3072, bf16, 2e-2)]
    for Kd, N, dt, tol in lin_cases:
        run.run(f"check linear {Kd}x{N} {dt}", lambda Kd=Kd, N=N, dt=dt, tol=tol: chk.check_linear(
            ops["linear"], device, dt, Kd, N, Ms, tol))
    for D in ([48] if smoke else [128, 4096]):
        run.run(f"check rms_norm D={D}", lambda D=D: chk.check_rms_norm(
            ops["rms_norm"], device, f32, D, [1, 3, 9] if smoke else [1, 3, 64, 2048], 1e-5))
    for V in ([100] if smoke else [512, 151936]):
        run.run(f"check log_softmax V={V}", lambda V=V: chk.check_log_softmax(
            ops["log_softmax"], ops["token_logprobs"], device, V, [1, 3, 9] if smoke else [1, 7, 64, 512], 1e-5))
    attn_cases = [(f32, 1e-5, [40, 3], 4, 2, 16, [16])] if smoke else [
        (f32, 1e-5, [2048, 1000, 37], 32, 8, 128, [512, 1000]),
        (bf16, 2e-2, [2048, 1000, 37], 32, 8, 128, [512, 1000])]
    for dt, tol, lens, Hq, Hkv, D, chunks in attn_cases:
        run.run(f"check attention {dt} lengths={lens}", lambda dt=dt, tol=tol, lens=lens, Hq=Hq, Hkv=Hkv, D=D,
                chunks=chunks: chk.check_attention(ops["attention"], device, dt, lens, Hq, Hkv, D, chunks,
                                                   n_decode=2 if smoke else 6, tol=tol))
    run.run("check gradients", lambda: chk.check_gradients(ops, device))

    # ------------------------------------------------------------------------------- timings
    import torch.nn.functional as F

    reps = 3 if smoke else 25
    gen = torch.Generator().manual_seed(0)

    def r(*shape, dtype=f32, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    lin_t = [(4, 48, 40, f32)] if smoke else [
        (M, 4096, 4096, dt) for dt in (bf16, f32) for M in (1, 64, 2048, 8192)]
    for M, Kd, N, dt in lin_t:
        def item(M=M, Kd=Kd, N=N, dt=dt):
            x, W = r(M, Kd, dtype=dt), r(N, Kd, dtype=dt, scale=Kd**-0.5)
            return compare(device, f"linear M={M} K={Kd} N={N} {dt}", lambda: F.linear(x, W),
                           lambda: K.triton_matmul.linear(x, W), reps)
        run.run(f"time linear M={M} {dt}", item)

    def rms_item(M, D, dt):
        x, w = r(M, D, dtype=dt), r(D, dtype=dt)

        def lib():
            x32 = x.float()
            return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)

        return compare(device, f"rms_norm M={M} D={D} {dt}", lib, lambda: K.triton_rms_norm.rms_norm(x, w, 1e-6), reps)

    for M, D, dt in ([(4, 48, f32)] if smoke else [(8192, 4096, bf16), (8192, 4096, f32)]):
        run.run(f"time rms_norm M={M} D={D} {dt}", lambda M=M, D=D, dt=dt: rms_item(M, D, dt))

    def lsm_item(M, V):
        x, t = r(M, V, scale=3.0), torch.randint(V, (M,), generator=gen).to(device)
        lib = lambda: torch.log_softmax(x / 0.7, -1).gather(-1, t[:, None])[:, 0]  # noqa: E731
        ours = lambda: K.triton_log_softmax.token_logprobs(x, t, 0.7)  # noqa: E731
        return [compare(device, f"token_logprobs M={M} V={V}", lib, ours, reps),
                compare(device, f"log_softmax M={M} V={V}", lambda: torch.log_softmax(x / 0.7, -1),
                        lambda: K.triton_log_softmax.log_softmax(x, 0.7), reps)]

    for M, V in ([(3, 100)] if smoke else [(1024, 151936), (4096, 512)]):
        run.run(f"time log_softmax M={M} V={V}", lambda M=M, V=V: lsm_item(M, V))

    def attn_prefill(B, T, Hq, Hkv, D, dt):
        q, k, v = r(B, T, Hq, D, dtype=dt), r(B, T, Hkv, D, dtype=dt), r(B, T, Hkv, D, dtype=dt)
        qt = q.transpose(1, 2)
        kt, vt = (t.transpose(1, 2).repeat_interleave(Hq // Hkv, 1) for t in (k, v))
        return compare(device, f"attention prefill B={B} T={T} Hq={Hq} Hkv={Hkv} D={D} {dt}",
                       lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                       lambda: K.triton_attention.attention(q, k, v), reps)

    def attn_decode(B, L, Hq, Hkv, D, dt):
        q, k, v = r(B, 1, Hq, D, dtype=dt), r(B, L, Hkv, D, dtype=dt), r(B, L, Hkv, D, dtype=dt)
        qt = q.transpose(1, 2)
        kt, vt = (t.transpose(1, 2).repeat_interleave(Hq // Hkv, 1) for t in (k, v))
        return compare(device, f"attention decode B={B} L={L} Hq={Hq} Hkv={Hkv} D={D} {dt}",
                       lambda: F.scaled_dot_product_attention(qt, kt, vt),
                       lambda: K.triton_attention.attention(q, k, v, q_start=L - 1), reps)

    prefill = [(1, 40, 4, 2, 16, f32)] if smoke else [(4, 2048, 32, 8, 128, bf16), (4, 2048, 32, 8, 128, f32)]
    for case in prefill:
        run.run(f"time attention prefill {case}", lambda case=case: attn_prefill(*case))
    decode = [(2, 40, 4, 2, 16, f32)] if smoke else [(64, 2048, 32, 8, 128, bf16), (64, 2048, 32, 8, 128, f32)]
    for case in decode:
        run.run(f"time attention decode {case}", lambda case=case: attn_decode(*case))

    emit(name="summary", failed_items=run.failed, total_s=round(time.time() - T_START, 1))
    return 0 if run.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
