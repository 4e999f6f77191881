"""A POSIX shared-memory segment for one weight version, with a header the receivers sign.

Layout: a 4 KiB header, then the flat weight buffer (`WeightLayout` offsets). The header holds
the version written into the segment, how many bytes of it are written so far (receivers may
follow the writer), and one "mapped" and one "done" byte per receiver; each process writes only
its own fields, so no locks are needed. Names are
`titanrl_ws_<creator pid>_<random>` (in /dev/shm on Linux), which lets a later sender remove
segments whose creator died without closing them.

`multiprocessing.shared_memory` is not used: before Python 3.13 every process that attaches
registers the segment with its resource tracker, which unlinks it (and warns) when that
process exits, under the feet of the owner.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

import _posixshmem
import torch

from titanrl.weight_sync.layout import WeightSyncError

PREFIX = "titanrl_ws_"
"""Name prefix of every segment TitanRL creates."""
HEADER_BYTES = 4096
MAX_RECEIVERS = 1024
_MAGIC = int.from_bytes(b"TRLWSYNC", "little")
_MAPPED, _DONE = 64, 64 + MAX_RECEIVERS  # byte offsets of the two flag arrays


class Segment:
    """One mapped segment (created by the sender, attached by receivers)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        """Created by this process (the sender), which unlinks it at the latest on close."""
        self.linked = True
        """Its name still exists (receivers can still attach); False once this process unlinked it."""
        self._mm = mm
        self._buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._head = self._buf[:64].view(torch.int64)

    @classmethod
    def create(cls, data_bytes: int, num_receivers: int) -> Segment:
        if not 1 <= num_receivers <= MAX_RECEIVERS:
            raise WeightSyncError(f"shared_memory supports 1..{MAX_RECEIVERS} receivers, got {num_receivers}")
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + max(data_bytes, 1))
            mm = mmap.mmap(fd, HEADER_BYTES + max(data_bytes, 1))
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        seg = cls(name, mm, owner=True)
        seg._head[:5] = torch.tensor([_MAGIC, -1, num_receivers, data_bytes, 0])
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise WeightSyncError(
                f"shared-memory segment {name!r} does not exist here: 'shared_memory' needs every rollout "
                "worker on the trainer's machine (use 'broadcast' otherwise), and a worker that restarted "
                "must open the weight sync again (its segments are only named until every worker mapped them)"
            ) from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        seg = cls(name, mm, owner=False)
        if int(seg._head[0]) != _MAGIC:
            seg.close()
            raise WeightSyncError(f"shared-memory segment {name!r} is not a TitanRL weight segment")
        return seg

    # --- header ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Version last written (-1: never)."""
        return int(self._head[1])

    @property
    def num_receivers(self) -> int:
        return int(self._head[2])

    @property
    def data_bytes(self) -> int:
        return int(self._head[3])

    @property
    def written(self) -> int:
        """Bytes of the data area written for `version` so far (every byte below is final)."""
        return int(self._head[4])

    def set_written(self, nbytes: int) -> None:
        """Sender: everything below `nbytes` is written. Stores become visible in program order
        only on CPUs with ordered stores (x86); see shared_memory.PIPELINED."""
        self._head[4] = nbytes

    @property
    def data(self) -> torch.Tensor:
        """The flat weight buffer (uint8 view of the mapping)."""
        return self._buf[HEADER_BYTES : HEADER_BYTES + self.data_bytes]

    def release_data_pages(self) -> None:
        """Drops this process's resident pages of the data area. The segment keeps them (a shared
        mapping of /dev/shm: the pages stay in the file, for every process that maps it), and this
        process maps them back on its next access. The sender calls it after writing a version,
        so a pushed model does not stay in the trainer's resident memory."""
        self._mm.madvise(mmap.MADV_DONTNEED, HEADER_BYTES, len(self._mm) - HEADER_BYTES)

    def begin(self, version: int) -> None:
        """Sender: about to write `version`; nobody has loaded it yet."""
        self._buf[_DONE : _DONE + self.num_receivers] = 0
        self._head[4] = 0
        self._head[1] = version

    def holds(self, tensor: torch.Tensor) -> bool:
        """True if `tensor`'s memory lies in this segment's mapping (a zero-copy Parameter)."""
        if self._buf is None:
            return False
        start = self._buf.data_ptr()
        return start <= tensor.data_ptr() < start + self._buf.numel()

    def mark_mapped(self, rank: int) -> None:
        self._buf[_MAPPED + rank - 1] = 1

    def mark_done(self, rank: int) -> None:
        self._buf[_DONE + rank - 1] = 1

    def all_mapped(self) -> bool:
        return bool(self._buf[_MAPPED : _MAPPED + self.num_receivers].all())

    def is_free(self) -> bool:
        """Never written, or every receiver has loaded what it holds: safe to overwrite."""
        return self.version == -1 or bool(self._buf[_DONE : _DONE + self.num_receivers].all())

    # --- lifetime ----------------------------------------------------------------------
    def unlink(self) -> None:
        """Removes the name; the memory lives on while any process maps it. Idempotent."""
        if self.linked:
            self.linked = False
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass  # another process (a receiver, or an earlier owner) removed it

    def close(self) -> None:
        """Unmaps (the owner also unlinks). Views handed out earlier keep the mapping alive until dropped."""
        if self.owner:
            self.unlink()
        self._buf = self._head = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_segments(directory: str = "/dev/shm") -> list[str]:
    """Unlinks TitanRL segments whose creating process no longer exists (a crash or kill -9 of
    a trainer); returns their names. Only where segments show up as files (Linux)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = []
    for path in root.glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("_")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                _posixshmem.shm_unlink("/" + path.name)
                removed.append(path.name)
            except FileNotFoundError:
                pass
    return removed


def segment_names(directory: str = "/dev/shm", pid: int | None = None) -> list[str]:
    """Names of TitanRL segments that still exist (of one creator pid if given), for checks."""
    root = Path(directory)
    if not root.is_dir():
        return []
    pattern = f"{PREFIX}{pid}_*" if pid is not None else f"{PREFIX}*"
    return sorted(p.name for p in root.glob(pattern))
