"""TitanRL's Ray actors allocate every thread's memory from one malloc arena
(`titanrl.driver.ray_runtime.init_ray`: MALLOC_ARENA_MAX=1).

A continuous rollout worker steps vLLM on a thread of its own; in an arena of its own that thread
paid ~16k page faults and 9 % more CPU per arithmetic batch (benchmarks/engine_thread.py).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import pytest


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # a libc without that name (musl, macOS)
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="malloc arenas are glibc's")


def malloc_heaps_after_a_thread_allocates() -> int:
    """How many malloc arenas (glibc `malloc_info` heaps) this process has once a new thread has
    allocated tensors."""
    import threading

    import torch

    thread = threading.Thread(target=lambda: [torch.ones(n).sum() for n in (16, 4096, 1 << 16)])
    thread.start()
    thread.join()
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as report:
        stream = libc.fopen(report.name.encode(), b"w")
        assert libc.malloc_info(0, stream) == 0
        libc.fclose(stream)
        return open(report.name).read().count("<heap nr=")


def test_a_new_thread_in_an_actor_allocates_from_the_one_arena(ray_session):
    """In a Ray task of the session (started by init_ray) a new thread's tensors come from the
    process's one arena; in a plain process (glibc's default) the same thread gets one of its own."""
    ray = ray_session
    in_actor = ray.get(ray.remote(num_cpus=0)(malloc_heaps_after_a_thread_allocates).remote())
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    plain = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                               "from test_ray_runtime import malloc_heaps_after_a_thread_allocates as f; print(f())"],
        env=env, capture_output=True, text=True, check=True)
    assert in_actor == 1
    assert int(plain.stdout.split()[-1]) >= 2  # the control: without the setting, the thread gets its own
