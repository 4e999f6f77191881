"""`titanrl plot RUN_DIR`: redraws `progress.png` from the run's `metrics.jsonl`."""

from __future__ import annotations

import os
from pathlib import Path

from titanrl.commands import CommandError
from titanrl.jsonl import JsonLinesError


def plot_command(run_dir: str | os.PathLike) -> Path:
    """Draws RUN_DIR/progress.png (titanrl.rundir.progress.plot_run); works while a run is still writing."""
    from titanrl.rundir.progress import plot_run

    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not run.is_dir():
        raise CommandError(f"run directory {str(run)!r} does not exist")
    if not metrics.is_file():
        raise CommandError(f"{str(run)!r} has no metrics.jsonl: is it a run directory (output.dir of a run)?")
    if not metrics.read_text().strip():
        raise CommandError(f"{str(metrics)!r} is empty: the run has not logged a step yet")
    try:
        return plot_run(run)
    except JsonLinesError as e:
        raise CommandError(str(e)) from e
