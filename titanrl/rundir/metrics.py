"""Run-directory logging: metrics.jsonl, TensorBoard events, rollouts.jsonl, and the W&B mirror."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from titanrl.jsonl import read_json_lines
from titanrl.rundir.wandb_mirror import WandbMirror


class MetricsLogger:
    """Appends one JSON object per step and flushes it, so a crash loses at most one line; then
    copies its scalars to TensorBoard and to W&B (`wandb`, a `WandbMirror`) when they are on."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: WandbMirror | None = None) -> None:
        self.run_dir = Path(run_dir)
        self._wandb = wandb
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")
        self._rollouts = open(self.run_dir / "rollouts.jsonl", "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        step = int(record["step"])
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._rollouts.write(json.dumps({"step": step, **row}) + "\n")
        self._rollouts.flush()

    def close(self, failed: bool = False) -> None:
        """Closes the files; `failed` (the run stopped early) marks the W&B run failed."""
        self._metrics.close()
        self._rollouts.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(failed=failed)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl` (read by `titanrl.jsonl`'s rule for a crash's cut-short line)."""
    return read_json_lines(Path(run_dir) / "metrics.jsonl").values()

