"""Weights & Biases as a mirror of the run directory (`output.wandb_project`).

The driver process alone talks to W&B: `MetricsLogger` hands each record to the mirror after
metrics.jsonl has it on disk, so the run directory stays the record. Any W&B failure (the
import, `wandb.init`, the network, a later `log`) is reported once as a warning and turns the
mirror off; it never stops the run. The W&B run id is kept in RUN_DIR/wandb_run_id.txt, so
`--resume` continues the same W&B run, and W&B's own files go under RUN_DIR/wandb/.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from titanrl.atomic_io import write_text_atomically
from titanrl.config.schema import OutputConfig

RUN_ID_FILE = "wandb_run_id.txt"

log = logging.getLogger("titanrl")


class WandbMirror:
    """One W&B run receiving the scalars of every metrics record, against the record's `step`."""

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def start(cls, output: OutputConfig, run_dir: Path, config_record: dict[str, Any]) -> WandbMirror | None:
        """The mirror of `run_dir` as `output` configures it; None when W&B is off or failed to start."""
        if not output.wandb_project or output.wandb_mode == "disabled":
            return None
        run = None
        try:
            import wandb

            id_file = run_dir / RUN_ID_FILE
            run_id = id_file.read_text().strip() if id_file.is_file() else None
            run = wandb.init(
                project=output.wandb_project,
                entity=output.wandb_entity or None,
                name=output.wandb_run_name or run_dir.name,
                id=run_id,
                resume="allow" if run_id else None,
                dir=str(run_dir),
                mode=output.wandb_mode,
                # A run of its own, leaving any run the user's script started alone; console
                # capture off: stdout/stderr stay the user's (tqdm, Ray's worker logs).
                reinit="create_new",
                settings=wandb.Settings(console="off"),
            )
            if run_id is None:
                write_text_atomically(id_file, run.id + "\n")
            # Charts against the training step: a resumed run writes its steps after the
            # checkpoint again, which W&B's own step counter would refuse as going backwards.
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            run.config.update(config_record, allow_val_change=True)
        except Exception as e:
            cls(run)._fail("start", e)
            return None
        return cls(run)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Sends one step's scalars; the first failure warns and turns the mirror off."""
        if self._run is None:
            return
        try:
            self._run.log({"step": step, **scalars})
        except Exception as e:
            self._fail("log", e)

    def finish(self, failed: bool = False) -> None:
        """Ends the W&B run (marked failed when the training run stopped early)."""
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1 if failed else 0)
            except Exception as e:
                _warn("finish", e)

    def _fail(self, what: str, error: Exception) -> None:
        """Warns (once: the mirror is off afterwards) and ends the W&B run as far as it still can."""
        _warn(what, error)
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:
                pass  # already reported: W&B is off for this run


def _warn(what: str, error: Exception) -> None:
    log.warning(f"W&B {what} failed ({type(error).__name__}: {error}); W&B logging is off for the rest of "
                "this run, which goes on: metrics.jsonl in the run directory has every step")
