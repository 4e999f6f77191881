"""Triton batch-invariant kernels: correctness (vs float64 torch) and bitwise invariance.

On this CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, NumPy per
program), which must be set before Triton is imported. So each CPU test runs its check in a
fresh `python tests/test_kernels_triton.py <check>` subprocess with the variable set, and the
pytest process itself never imports Triton in interpreter mode (other tests are unaffected).
All interpreted checks share one such subprocess (one start and import of torch and Triton);
each check's result or error is reported to its own test.
Shapes are tiny there. The `gpu`-marked tests run the same checks in-process on CUDA at
larger shapes (skipped without a GPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _ops():
    from titanrl.kernels import triton_attention, triton_log_softmax, triton_matmul, triton_rms_norm

    return dict(
        linear=triton_matmul.linear,
        rms_norm=triton_rms_norm.rms_norm,
        log_softmax=triton_log_softmax.log_softmax,
        token_logprobs=triton_log_softmax.token_logprobs,
        attention=triton_attention.attention,
    )


def run_check(name: str, device: str) -> list[dict]:
    """Runs one named group of checks on `device`; returns their result dicts."""
    from support import kernel_checks as checks

    ops, cuda = _ops(), device == "cuda"
    if name == "linear":
        shapes = [(4096, 4096), (1024, 3072), (4096, 7)] if cuda else [(48, 40), (32, 7), (5, 33)]
        Ms = [1, 2, 3, 4, 7, 16, 33, 128, 511, 2048] if cuda else [1, 2, 3, 5, 17, 33]
        dtypes = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)] if cuda else [(torch.float32, 1e-5)]
        return [checks.check_linear(ops["linear"], device, dt, K, N, Ms, tol) for K, N in shapes for dt, tol in dtypes]
    if name == "rms_norm":
        dims = [128, 4096, 5000] if cuda else [48, 4100]
        Ms = [1, 2, 3, 64, 2048] if cuda else [1, 2, 5, 9]
        return [checks.check_rms_norm(ops["rms_norm"], device, torch.float32, D, Ms, 1e-5) for D in dims]
    if name == "log_softmax":
        vocab = [512, 151936] if cuda else [100, 5000]
        Ms = [1, 7, 64, 512] if cuda else [1, 2, 5, 9]
        return [
            checks.check_log_softmax(ops["log_softmax"], ops["token_logprobs"], device, V, Ms, 1e-5) for V in vocab
        ]
    if name == "attention":
        if cuda:
            cases = [(torch.float32, 1e-5, [512, 37, 300], 8, 2, 128, [1, 64, 100]),
                     (torch.bfloat16, 2e-2, [512, 37, 300], 8, 2, 128, [64, 100])]
        else:
            cases = [(torch.float32, 1e-5, [40, 3, 21], 4, 2, 16, [1, 7, 16]),
                     (torch.float32, 1e-5, [20, 9], 3, 1, 24, [5])]
        return [
            checks.check_attention(ops["attention"], device, dt, lens, Hq, Hkv, D, chunks, n_decode=2, tol=tol)
            for dt, tol, lens, Hq, Hkv, D, chunks in cases
        ]
    if name == "gradients":
        return [checks.check_gradients(ops, device)]
    raise ValueError(f"unknown check {name!r}")


def compile_for_sm90() -> list[dict]:
    """Compiles every kernel config the GPU path uses for sm_90 (H100/H200) with Triton's
    NVIDIA backend and ptxas, without a GPU: catches what the interpreter cannot (non-constexpr
    globals, type errors, shared-memory overflows)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from titanrl.kernels import triton_attention, triton_log_softmax, triton_matmul, triton_rms_norm

    def build(kernel, types: dict[str, str], constexprs: dict, options: dict, label: str) -> dict:
        signature = {n: types.get(n, "constexpr") for n in kernel.arg_names}
        try:
            compiled = triton_compile(
                ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                target=GPUTarget("cuda", 90, 32), options=options,
            )
            shared = compiled.metadata.shared
            return dict(kernel=label, shared_bytes=shared, ok=shared <= 160 * 1024)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            return dict(kernel=label, error=repr(exc)[-2000:], ok=False)

    i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
    out = []
    for dt, cfg, ieee in [("fp32", triton_matmul.MatmulConfig(64, 64, 32, 4, 3), True),
                          ("bf16", triton_matmul.MatmulConfig(128, 128, 64, 8, 3), False)]:
        types = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}",
                     **i32("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk", "stride_ym", "stride_yn"))
        out.append(build(triton_matmul._linear_kernel, types,
                         dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee),
                         dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), f"linear {dt}"))
    for dt in ("fp32", "bf16"):
        out.append(build(triton_rms_norm._rms_norm_kernel,
                         dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", y_ptr=f"*{dt}", eps="fp32",
                              **i32("D", "stride_x", "stride_y")),
                         dict(BLOCK=4096), {}, f"rms_norm {dt}"))
        out.append(build(triton_log_softmax._lse_kernel,
                         dict(x_ptr=f"*{dt}", lse_ptr="*fp32", inv_temp="fp32", **i32("V", "stride_x")),
                         dict(BLOCK=4096), {}, f"logsumexp {dt}"))
        out.append(build(triton_log_softmax._log_softmax_write_kernel,
                         dict(x_ptr=f"*{dt}", lse_ptr="*fp32", y_ptr="*fp32", inv_temp="fp32",
                              **i32("V", "stride_x", "stride_y")),
                         dict(BLOCK=4096), dict(enable_fp_fusion=False), f"log_softmax write {dt}"))
    strides = ("sqb", "sqt", "sqh", "skb", "skt", "skh", "svb", "svt", "svh", "sob", "sot", "soh")
    for dt, ieee in (("fp32", True), ("bf16", False)):
        for D in (64, 128):
            types = dict(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", o_ptr=f"*{dt}", q_start_ptr="*i32",
                         kv_len_ptr="*i32", scale="fp32", **i32("Tq", "Hq", "G", "D", *strides))
            out.append(build(triton_attention._attention_kernel, types,
                             dict(BLOCK_Q=64, BLOCK_K=64, BLOCK_D=D, IEEE=ieee),
                             dict(num_warps=8 if D >= 128 else 4, num_stages=2), f"attention {dt} D={D}"))
    return out


def _interpreted(name: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    if name == "compile_sm90":
        env.pop("TRITON_INTERPRET")  # a real compile, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), name], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"interpreter run of {name} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


CHECKS = ["linear", "rms_norm", "log_softmax", "attention", "gradients"]


def run_checks_reporting_errors(names: list[str], device: str) -> dict[str, list[dict]]:
    """`run_check` of each name; a check that raises gives one failed result holding its traceback
    (the others still run)."""
    import traceback

    out = {}
    for name in names:
        try:
            out[name] = run_check(name, device)
        except Exception:  # noqa: BLE001 - reported to that check's test
            out[name] = [dict(check=name, error=traceback.format_exc()[-4000:], ok=False)]
    return out


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, list[dict]]:
    """Every interpreted check's results, from one interpreter subprocess."""
    return _interpreted("interpreted")


@pytest.mark.parametrize("name", CHECKS)
def test_triton_kernel_interpreted_on_cpu(name, interpreted_results):
    """Under Triton's CPU interpreter, each kernel matches float64 torch (1e-5 relative; 1e-5
    absolute for gradients) and gives a row/query bitwise the same output alone and inside
    batches of other sizes at random positions (attention: full forward = prefill = chunked
    prefill = decode)."""
    results = interpreted_results[name]
    assert results
    for res in results:
        assert res["ok"], res


def test_triton_kernels_compile_for_sm90_without_gpu():
    """Every kernel config of the GPU path compiles to a cubin for sm_90 (H100/H200) with
    Triton's NVIDIA backend and ptxas, and fits in 160 KB of shared memory (A100 and later)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    ptxas = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton build has no NVIDIA backend (ptxas)")
    for res in _interpreted("compile_sm90"):
        assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.parametrize("name", CHECKS)
def test_triton_kernel_on_cuda(name):
    """The same checks on a CUDA GPU at larger shapes (K = N = 4096, M up to 2048, V = 151,936,
    attention with head_dim 128, GQA, float32 and bfloat16)."""
    for res in run_check(name, "cuda"):
        assert res["ok"], res


@pytest.mark.gpu
def test_dispatch_picks_triton_on_cuda():
    """`titanrl.kernels.backend` returns 'triton' for CUDA tensors and the package ops run it."""
    from titanrl import kernels
    from titanrl.kernels import triton_matmul

    x = torch.randn(5, 64, device="cuda")
    W = torch.randn(32, 64, device="cuda")
    assert kernels.backend(x) == "triton"
    assert torch.equal(kernels.linear(x, W), triton_matmul.linear(x, W))


if __name__ == "__main__":
    # Subprocess entry: `TRITON_INTERPRET=1 python tests/test_kernels_triton.py <check>`,
    # `... interpreted` (every check, results by name), or
    # `python tests/test_kernels_triton.py compile_sm90` (no interpreter).
    sys.path.insert(0, str(REPO))
    if sys.argv[1] == "compile_sm90":
        print(json.dumps(compile_for_sm90()))
    elif sys.argv[1] == "interpreted":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(json.dumps(run_checks_reporting_errors(CHECKS, "cpu")))
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(json.dumps(run_check(sys.argv[1], "cpu")))
