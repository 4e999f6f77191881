"""Compiles a C++ kernel of `titanrl/kernels/csrc/` once per machine and loads it with ctypes.

The kernels take raw pointers and strides, so they need neither torch's headers nor pybind:
a build is one `g++` call of about a second (a torch C++ extension costs ~40 s of compiling
torch headers on these machines), and the library links nothing but libm and OpenMP
(`libgomp.so.1`, which resolves to the copy torch has already loaded).

Builds are cached under `$TITANRL_KERNEL_CACHE` (default `~/.cache/titanrl/kernels`), keyed
by the source, the flags, the compiler's version and the CPU's instruction set; each is written to a temporary file and
renamed into place, so processes that build at the same moment (a trainer and its rollout
engines) never load a half-written library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "csrc"
"""Where the kernels' C++ sources live."""
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-std=c++17")
"""-march=native only widens the vectors: with -ffp-contract=off and no -ffast-math the compiler
may not fuse or reorder float operations, so the bits follow the source's arithmetic in every
build (csrc/attention.cpp spells its reduction order out). Builds are per CPU type (see `load`)."""


class KernelBuildError(RuntimeError):
    """A C++ kernel could not be compiled or loaded; the message says what to install or set."""


def cache_dir() -> Path:
    """Directory holding the compiled libraries."""
    root = os.environ.get("TITANRL_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "titanrl" / "kernels"


def _cpuinfo_line(*keys: str) -> str | None:
    """The first /proc/cpuinfo line that starts with one of `keys`, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def cpu_flags_line() -> str:
    """The CPU's instruction-set flags line from /proc/cpuinfo (`flags`, or `Features` on ARM);
    the processor name where there is none."""
    return _cpuinfo_line("flags", "Features") or platform.processor()


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ('AMD EPYC ...'), the processor name where there is none."""
    line = _cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line else platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor string from /proc/cpuinfo (`GenuineIntel`, `AuthenticAMD`, ...), or ''."""
    line = _cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def has_avx512() -> bool:
    """True where the CPU has AVX-512 (its foundation flag, avx512f)."""
    return "avx512f" in cpu_flags_line().split()


def isa_flags() -> str:
    """The instruction-set extensions that decide kernel speed here (AVX / AVX-512 / AMX / FMA),
    sorted: what every benchmark line records about its CPU."""
    return " ".join(sorted(f for f in cpu_flags_line().split() if f.startswith(("avx", "amx", "fma"))))


def _cpu_features() -> bytes:
    """The CPU's instruction-set flags: a -march=native build is only loaded on a matching CPU."""
    return cpu_flags_line().encode()


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise KernelBuildError(
            f"batch-invariant attention on CPU compiles a small C++ kernel on first use, but the compiler "
            f"{cxx!r} was not found: install one (Debian/Ubuntu: apt-get install g++) or point CXX at it"
        )
    return cxx


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The compiled `csrc/<name>.cpp`, built on first use (about a second) and cached."""
    source = SOURCES / f"{name}.cpp"
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), version.encode(), platform.machine().encode(),
                    _cpu_features()])
    ).hexdigest()[:16]
    library = cache_dir() / f"{name}-{key}.so"
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home directory: build per user under the temp dir
        library = Path(tempfile.gettempdir()) / f"titanrl-kernels-{os.getuid()}" / library.name
        library.parent.mkdir(parents=True, exist_ok=True)
    if not library.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True)
            if done.returncode != 0:
                raise KernelBuildError(f"compiling {source} with {cxx} failed:\n{done.stderr[-4000:]}")
            os.replace(tmp, library)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(library))
    except OSError as e:
        raise KernelBuildError(f"loading the compiled kernel {library} failed: {e}; delete it to rebuild") from e
