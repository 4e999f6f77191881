"""Atomic, durable replacement of a directory (or a file) on disk: the one implementation.

`replacing_directory(final)` yields a temporary directory beside `final` to fill. When the body
returns, every file and directory under it is fsynced, it is renamed to `final` (an existing
`final` is first renamed aside and removed afterwards), and the parent directory is fsynced so
the rename itself survives a power cut. If the body raises, the temporary directory is removed
and `final` is untouched. So a reader sees either the old complete directory or the new
complete one, never a half-written one.

Temporaries are named `.<name>.tmp-<pid>` and the set-aside old copy `.<name>.old-<pid>`, so a
crashed process's leftovers are recognisable (see `titanrl.rundir.checkpoints.remove_stale_temporaries`).

A leaf module (standard library only): models/, rundir/ and commands/ all import it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_name(final: Path) -> Path:
    """Where `replacing_directory(final)` builds the new contents."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def set_aside_name(final: Path) -> Path:
    """Where an existing `final` waits while the new one is renamed into place."""
    return final.with_name(f".{final.name}.old-{os.getpid()}")


@contextmanager
def replacing_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty temporary directory beside `final`; on success it becomes `final`, durably."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(final)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed process with the same pid
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            old = set_aside_name(final)
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_directory(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Replaces the file `path` with `text`: written beside it, fsynced, renamed, parent fsynced."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_tree(root: Path) -> None:
    """fsyncs every regular file and directory under `root` (and `root`), deepest first."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            file = Path(directory) / name
            if file.is_file() and not file.is_symlink():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_directory(Path(directory))


def fsync_directory(path: Path) -> None:
    """Makes the entries of directory `path` (a rename into it, say) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
