"""Resident memory of this process, for the memory metrics and the memory benchmark.

Peak resident set size is what the kernel's OOM killer and Ray's memory monitor look at, so
it is the number a user compares with the machine's memory (not the allocator's view).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys

GIB = 1 << 30


def peak_rss_bytes() -> int:
    """Highest resident set size this process has had since it started (getrusage)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return peak_rss_bytes()


def peak_rss_gib() -> float:
    return peak_rss_bytes() / GIB


@functools.cache
def _libc() -> ctypes.CDLL:
    """This process's C library (raises OSError where there is none to load)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


_M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""


LARGE_MODEL_PARAMS = 100_000_000
"""From this many parameters on, `auto_heap_mmap_threshold_mib` keeps the heap small (1 MiB)."""


def auto_heap_mmap_threshold_mib(total_params: int) -> int:
    """train.memory.heap_mmap_threshold_mib=None: 1 MiB for a model of `LARGE_MODEL_PARAMS` or more, 32 MiB
    (glibc's largest) below. Measured on a 2-core AVX-512 EPYC (2026-12-05, -06):
    - a real run at Qwen3-0.6B's shape with 4 sequences per micro-batch (what the memory plan
      picks on a 24 GB machine; benchmarks/actor_memory.py's command): trainer peak 12.72 GiB at
      4 MiB, 11.66 GiB at 1 MiB (hidden-size activations of 2.2 MB fragmented the heap below
      4 MiB); trainer alone at 8 layers (benchmarks/trainer_memory.py, micro_batches arms): the
      same peak, the step 1.014x as long at 1 MiB;
    - at Qwen3-0.6B's shape (2 layers of it, benchmarks/trainer_memory.py) 4 MiB keeps the
      trainer's peak at 0.91x glibc's own heap and 0.93x a 16 MiB threshold; at the full depth
      9.88 GiB against glibc's 12.15;
    - on the 19M model (benchmarks/heap_threshold.py) every activation is a few MiB, and at
      4 MiB each one is a fresh mapping: 565k page faults and 1.0 s of system time per step, a
      step 1.33x slower than at 32 MiB (47k faults)."""
    return 1 if total_params >= LARGE_MODEL_PARAMS else 32


def set_heap_mmap_threshold(mib: int) -> bool:
    """Makes glibc serve allocations of >= `mib` MiB by mmap, returned to the kernel on free
    (fixing the threshold also stops glibc from raising it). Returns whether it took effect:
    False for 0, or off glibc."""
    if mib <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # musl and other libcs without mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mib << 20))


_MADV_DONTNEED = 4
_OBJECT_STORE_FILE = "/dev/shm/plasma"
"""Ray's object store on Linux: one shared file mapping per process (`/dev/shm/plasma... (deleted)`)."""


def release_object_store_pages() -> int:
    """Unmaps from this process the pages of Ray's object store it has touched (returns the bytes
    of the ranges advised). Writing a result into the store maps its pages into the writer, and
    they stay resident there after the object is freed: a trainer that publishes its weights
    through the object store carried one model's size in its resident memory into every step.
    The store's file keeps the data (MADV_DONTNEED on a shared mapping only drops this process's
    page-table entries; a later read faults the pages back in), so objects stay intact."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/maps") as f:
            ranges = [line.split()[0] for line in f if _OBJECT_STORE_FILE in line]
        if not ranges:
            return 0
        madvise = _libc().madvise
    except OSError:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for span in ranges:
        lo, hi = (int(x, 16) for x in span.split("-"))
        if madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            released += hi - lo
    return released
