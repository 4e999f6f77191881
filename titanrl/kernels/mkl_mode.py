"""MKL's strict AVX2 code path, which the batch-invariant linear needs on AVX-512 CPUs.

`torch_linear` keeps a row's bits fixed by padding every GEMM into the shape classes in which
MKL's AVX2 kernels compute a row the same way whatever else is in the call (measured on AVX2
machines). On a CPU with AVX-512 (measured: Intel Xeon with AVX-512 and AMX, torch 2.13, MKL
2024.0), MKL dispatches to its AVX-512/AMX kernels, whose per-row arithmetic depends on the row
count and on the row's position, and the padding no longer holds a row's bits: batch-invariant
logprobs then differ by ~1e-7 between a sequence alone and in a batch. MKL's Conditional
Numerical Reproducibility mode `AVX2,STRICT` runs the AVX2 kernels (strictly, whatever the
thread count) on any Intel CPU that has AVX2, and with it every row-invariance check of
tests/test_kernels.py passes there again.

On AMD CPUs with AVX-512 (measured: an EPYC with avx512f/bw/dq/vl/bf16, torch 2.13) MKL keeps
to the code path it takes on non-Intel processors: that path passes the same row checks in its
default mode, and MKL refuses the AVX2 branch there (`mkl_cbwr_set` returns -3; `MKL_CBWR=AVX2,STRICT`
turns into its slower COMPATIBLE branch). So only Intel CPUs with AVX-512 are pinned;
tests/test_mkl_mode.py checks the default rows wherever no pinning is asked for.

MKL takes the mode only before its first GEMM in the process. So:
- a process started by TitanRL for a batch-invariant run (the trainer, the rollout workers)
  gets `MKL_CBWR=AVX2,STRICT` in its environment (`actor_env`), which MKL reads when it starts;
- `ensure_strict_mkl` (called by the batch-invariant linear) sets the mode in a process that has
  not run a GEMM yet, and otherwise raises an error that says what to set.
Outside batch-invariant mode nothing changes: the library kernels keep their fastest path.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from titanrl.kernels.cpu_build import cpu_vendor, has_avx512

ENV_VAR, ENV_VALUE = "MKL_CBWR", "AVX2,STRICT"
"""The environment variable MKL reads at start-up for its reproducibility mode, and our value."""
_CBWR_ALL, _CBWR_AVX2, _CBWR_STRICT = -1, 10, 0x10000
"""mkl_cbwr.h: MKL_CBWR_ALL (query every setting), MKL_CBWR_AVX2, MKL_CBWR_STRICT."""


@functools.cache
def needs_strict_mkl() -> bool:
    """True on an Intel CPU with AVX-512 when torch's GEMMs go through MKL (where the padding
    alone does not keep a row's bits: see the module docstring)."""
    return torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel" and has_avx512()


@functools.cache
def _mkl_library() -> ctypes.CDLL | None:
    """torch's CPU library, which links MKL statically (its service functions are exported)."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        library = ctypes.CDLL(str(path))
        library.mkl_serv_cbwr_get.argtypes = library.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return library


_strict = False
"""Set once this process is known to run MKL in `AVX2,STRICT` mode."""


def ensure_strict_mkl() -> None:
    """Makes sure this process's MKL runs its strict AVX2 path where `needs_strict_mkl()`;
    raises RuntimeError (naming `MKL_CBWR`) if MKL already ran a GEMM in another mode."""
    global _strict
    if _strict or not needs_strict_mkl():
        return
    library = _mkl_library()
    if library is None and os.environ.get(ENV_VAR) == ENV_VALUE:
        _strict = True  # MKL read the mode at start-up; this torch build only hides the query
        return
    if library is None:
        raise RuntimeError(
            f"batch-invariant kernels on this AVX-512 CPU need MKL's {ENV_VALUE} mode, but {torch.__file__}'s "
            f"libtorch_cpu.so exports no mkl_serv_cbwr_* functions to set it: start Python with "
            f"{ENV_VAR}={ENV_VALUE} in the environment")
    wanted = _CBWR_AVX2 | _CBWR_STRICT
    if library.mkl_serv_cbwr_get(_CBWR_ALL) != wanted and library.mkl_serv_cbwr_set(wanted) != 0:
        raise RuntimeError(
            f"batch-invariant kernels on this AVX-512 CPU need MKL's {ENV_VALUE} reproducibility mode, which MKL "
            f"only takes before its first matrix multiply, and this process has already run one. Start the "
            f"process with {ENV_VAR}={ENV_VALUE} in its environment (titanrl's own actors get it when "
            f"batch_invariant=True), or use the batch-invariant kernels before any other torch matmul")
    _strict = True


def actor_env() -> dict[str, str]:
    """Environment variables for a process that will run batch-invariant kernels (empty where
    the default MKL mode already keeps a row's bits)."""
    return {ENV_VAR: ENV_VALUE} if needs_strict_mkl() else {}
