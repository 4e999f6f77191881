"""MKL's strict AVX2 mode for the batch-invariant linear on AVX-512 CPUs (titanrl.kernels.mkl_mode).

Each check runs in a fresh Python process without MKL_CBWR (this session's processes have it:
tests/conftest.py), because MKL takes its mode only before its first matmul.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from titanrl.kernels.mkl_mode import ENV_VAR, needs_strict_mkl

needs_pinning = pytest.mark.skipif(not needs_strict_mkl(), reason="only Intel AVX-512 CPUs with MKL need the strict mode")

# Rows of one input alone, inside a batch of 37, and at every position of it: the bits must agree.
ROW_CHECK = textwrap.dedent("""
    import torch
    from titanrl.kernels.torch_linear import linear_rows
    gen = torch.Generator().manual_seed(0)
    def invariant(K, N):
        w, x = torch.randn(N, K, generator=gen), torch.randn(37, K, generator=gen)
        full = linear_rows(x, w)
        alone = all(torch.equal(linear_rows(x[i:i + 1], w)[0], full[i]) for i in range(37))
        return alone and all(torch.equal(linear_rows(x[:i + 1], w)[i], full[i]) for i in range(37))
    shapes = [(128, 128), (512, 512), (512, 1536), (129, 7)]
    print("invariant" if all(invariant(K, N) for K, N in shapes) else "variant")
""")


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@needs_pinning
def test_a_fresh_process_is_pinned_and_its_rows_are_invariant():
    done = _run(ROW_CHECK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "invariant"


@needs_pinning
def test_without_the_strict_mode_the_rows_are_not_invariant():
    """The negative control: the same check with the pinning skipped fails on this CPU."""
    done = _run("import titanrl.kernels.mkl_mode as m; m._strict = True\n" + ROW_CHECK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "variant"


@needs_pinning
def test_too_late_to_pin_is_a_clear_error():
    done = _run(textwrap.dedent("""
        import torch
        torch.randn(8, 64) @ torch.randn(64, 32)  # MKL starts in its default mode
        from titanrl import kernels
        kernels.linear(torch.randn(4, 64), torch.randn(32, 64))
    """))
    assert done.returncode != 0
    assert "RuntimeError" in done.stderr and f"{ENV_VAR}=AVX2,STRICT" in done.stderr, done.stderr


@needs_pinning
def test_the_environment_variable_pins_a_process_that_already_ran_a_matmul():
    code = "import torch\ntorch.randn(8, 64) @ torch.randn(64, 32)\n" + ROW_CHECK
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV_VAR: "AVX2,STRICT"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "invariant"


@pytest.mark.skipif(needs_strict_mkl(), reason="this CPU needs the strict mode (the tests above)")
def test_where_no_pinning_is_asked_for_the_default_rows_are_invariant():
    """The claim behind `needs_strict_mkl() == False` (AVX2 CPUs, AMD CPUs with AVX-512): a fresh
    process in MKL's default mode keeps a row's bits alone, in a batch and at every position."""
    done = _run("import titanrl.kernels.mkl_mode as m; m._strict = True\n" + ROW_CHECK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "invariant"
