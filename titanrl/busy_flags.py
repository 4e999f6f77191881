"""Which rollout workers on this machine are generating right now: one byte each in a /dev/shm file.

The driver creates the file for a run with `train.compute.threads_when_rollouts_idle` set; each worker's
engine raises its byte while it samples (`BusySlot`), and the trainer reads them all
(`BusyFlags.any_busy`) to take the cores of workers that wait for the next weights
(`titanrl.trainer.idle_cores`). A mapped page: a write or a read is one byte, without a lock or a
system call, so the trainer can look once per decoder layer.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

SHM_DIR = "/dev/shm"
"""Where the file lives: tmpfs on Linux, so the bytes never reach a disk."""
FILE_PREFIX = "titanrl-busy-"
"""The start of each run's file name (followed by the driver's pid and a random suffix)."""


class BusyFlags:
    """One byte per rollout worker (1: generating) in a shared file, mapped into this process."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Maps the existing file at `path` (made by `create`)."""
        self.path = str(path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)  # the mapping keeps the pages

    @classmethod
    def create(cls, num_workers: int, directory: str = SHM_DIR) -> BusyFlags:
        """A new file of `num_workers` zero bytes (nobody generating) in `directory`."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        path = Path(directory) / f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(path, "xb") as f:
            f.write(bytes(num_workers))
        return cls(path)

    def slot(self, index: int) -> BusySlot:
        """Worker `index`'s byte."""
        if not 0 <= index < self.size:
            raise IndexError(f"worker {index} has no byte in {self.path} ({self.size} workers)")
        return BusySlot(self, index)

    def set(self, index: int, busy: bool) -> None:
        self._map[index] = 1 if busy else 0

    def any_busy(self) -> bool:
        """Whether any worker is generating now."""
        return self._map.find(b"\x01") >= 0

    def unlink(self) -> None:
        """Removes the file (mappings stay valid until closed); a file already gone is fine."""
        Path(self.path).unlink(missing_ok=True)


class BusySlot:
    """A worker's byte: `with slot:` marks the worker generating for the block; `set` for a
    state that spans calls (the continuous engine's pump). `BusySlot.none()` does nothing."""

    def __init__(self, flags: BusyFlags | None, index: int = 0) -> None:
        self.flags, self.index = flags, index

    @classmethod
    def none(cls) -> BusySlot:
        """A slot that records nothing (a run without `train.compute.threads_when_rollouts_idle`)."""
        return cls(None)

    @classmethod
    def open(cls, path: str | None, index: int) -> BusySlot:
        """Worker `index`'s byte of the file at `path`; `none()` when path is None."""
        return cls.none() if path is None else BusyFlags(path).slot(index)

    def set(self, busy: bool) -> None:
        if self.flags is not None:
            self.flags.set(self.index, busy)

    def __enter__(self) -> BusySlot:
        self.set(True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.set(False)
