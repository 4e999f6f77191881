"""Resident memory of this process, for the memory metrics and the memory benchmark.

Peak resident set size is what the kernel's OOM killer and Ray's memory monitor look at, so
it is the number a user compares with the machine's memory (not the allocator's view).
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


_M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (glibc's malloc.h)."""


def set_heap_mmap_threshold(mib: int) -> bool:
    """Makes glibc serve allocations of >= `mib` MiB by mmap, returned to the kernel on free
    (fixing the threshold also stops glibc from raising it). Returns whether it took effect:
    False for 0, or off glibc."""
    if mib <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs without mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mib << 20))
