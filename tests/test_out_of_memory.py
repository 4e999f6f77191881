"""A run that dies of memory says so, and names the settings that lower it."""

from __future__ import annotations

import pytest
import torch
from ray.exceptions import OutOfMemoryError

from titanrl.driver.out_of_memory import MEMORY_SETTINGS, caused_by_memory, memory_hint
from titanrl.memory import current_rss_bytes, peak_rss_bytes

# Ray's own wording for an actor its memory monitor ended, and for a SIGKILLed worker.
RAY_MONITOR_KILL = ("The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY "
                    "Worker exit detail: Task was killed due to the node running out of memory.")
RAY_SIGKILL = ("A worker died or was killed while executing a task by an unexpected system error. Potential root "
               "causes include: (1) The process is killed by SIGKILL by OOM killer due to high memory usage.")


@pytest.mark.parametrize("error", [
    OutOfMemoryError("Task was killed due to the node running out of memory."),
    RuntimeError(RAY_MONITOR_KILL),
    RuntimeError(RAY_SIGKILL),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
])
def test_memory_deaths_are_recognised(error: BaseException) -> None:
    assert caused_by_memory(error)
    hint = memory_hint(error)
    assert "ran out of memory" in hint and MEMORY_SETTINGS in hint
    for setting in (
        "train.memory.micro_batch_size",
        "train.memory.activation_checkpointing",
        "rollout.engine.kv_cache_gib",
    ):
        assert setting in hint


def test_a_memory_error_is_found_through_the_exception_chain() -> None:
    try:
        try:
            raise OutOfMemoryError("node out of memory")
        except OutOfMemoryError as inner:
            raise RuntimeError("trainer step failed") from inner
    except RuntimeError as outer:
        assert caused_by_memory(outer)


@pytest.mark.parametrize("error", [ValueError("bad reward"), RuntimeError("no room in the buffer (boom)"),
                                   KeyboardInterrupt()])
def test_other_failures_get_no_memory_hint(error: BaseException) -> None:
    assert not caused_by_memory(error)
    assert memory_hint(error) == ""


def test_resident_memory_counts_a_touched_allocation() -> None:
    before = current_rss_bytes()
    block = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, every page written
    grown = current_rss_bytes() - before
    assert grown >= 200 << 20, grown
    # The kernel updates its high-water mark lazily (by a few pages).
    assert peak_rss_bytes() >= current_rss_bytes() - (4 << 20)
    del block
