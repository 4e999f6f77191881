"""Training checkpoints inside a run directory: where they live, which are complete, atomic writes.

    <run_dir>/checkpoints/step_000040/
        checkpoint.json      written last: step, policy version, whether it resumes exactly
        trainer/             model + optimizer (torch.distributed.checkpoint), scheduler, RNG
        driver.pt            data-stream position, request counters, rollouts not yet trained on
                             (plain data, read with weights_only=True: `titanrl.rundir.driver_state`)

A checkpoint is written under a temporary name and renamed into place only when every part
is on disk, so a crash while writing leaves the previous checkpoint intact and the
half-written one is never mistaken for a complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.atomic_io import replacing_directory

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "checkpoint.json"
_NAME = re.compile(r"^step_(\d+)$")


class RunCheckpointError(RuntimeError):
    """A run has no usable checkpoint where one was asked for; the message lists what exists."""


@dataclass(frozen=True)
class RunCheckpoint:
    """One complete training checkpoint of a run."""

    step: int
    """Training step after which it was written."""
    path: Path
    """Its directory."""

    def manifest(self) -> dict[str, Any]:
        return json.loads((self.path / MANIFEST).read_text())


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[RunCheckpoint]:
    """Complete checkpoints of a run, oldest first; temporary and half-written ones are skipped."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and (entry / MANIFEST).is_file():
            found.append(RunCheckpoint(int(match.group(1)), entry))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(run_dir: str | os.PathLike) -> RunCheckpoint | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def find_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> RunCheckpoint:
    """The checkpoint of `step` (newest when None), or an error naming the steps that exist."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise RunCheckpointError(
            f"{str(run_dir)!r} has no complete training checkpoint under {CHECKPOINTS_DIR}/ "
            "(set output.save_every_steps=N to write them during a run)"
        )
    if step is None:
        return checkpoints[-1]
    for c in checkpoints:
        if c.step == step:
            return c
    raise RunCheckpointError(
        f"{str(run_dir)!r} has no checkpoint of step {step}; steps with one: {[c.step for c in checkpoints]}"
    )


@contextmanager
def writing_checkpoint(run_dir: str | os.PathLike, step: int, manifest: dict[str, Any]) -> Iterator[Path]:
    """Yields a temporary directory to fill; on success writes the manifest and renames it into place.

    An exception leaves nothing under the final name (the temporary directory is removed).
    Re-writing an existing step replaces it only after the new one is complete.
    """
    with replacing_directory(checkpoint_path(run_dir, step)) as tmp:
        yield tmp
        _write_json_durably(tmp / MANIFEST, {"step": step, **manifest})


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Deletes half-written checkpoints a crashed process left behind; returns what it removed."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    removed = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".step_") and (".tmp-" in entry.name or ".old-" in entry.name):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
