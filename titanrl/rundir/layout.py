"""The run directory: created once per run, reopened by `--resume`, never silently overwritten."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from titanrl.atomic_io import write_text_atomically
from titanrl.config import RunConfig
from titanrl.config.record import config_record
from titanrl.config.renamed import current_key
from titanrl.errors import ConfigError
from titanrl.jsonl import read_json_lines
from titanrl.rundir.checkpoints import RunCheckpoint, latest_checkpoint, remove_stale_temporaries

CONFIG_FILE = "config.json"
RESOLVED_CONFIG_FILE = "config.resolved.json"
RESUMABLE_SECTIONS = ("output",)
"""Config sections a resumed run may change; everything else must match the checkpointed run."""
RESUMABLE_KEYS = (
    "train.steps",
    "train.compute.compile",
    "train.compute.threads_when_rollouts_idle",
    "train.compute.cpu_matmul",
)
"""Single keys a resumed run may change: a longer or shorter run of the same job, and compiled
blocks or the CPU matmul library switched (the same training, not the same bits: other kernels
round differently)."""
RESUMABLE_PREFIXES = ("train.parallel.", "train.compute.device")
"""Keys a resumed run may change because checkpoints reshard on load: a run saved with
dp_shard=2 can continue with tp=2 (the same training, not the same bits: reduction orders differ)."""


def write_resolved_config(run_dir: Path, resolved: Any) -> None:
    """`config.resolved.json`: the config with every derived value filled, and what the checkpoint
    holds (a `titanrl.config.resolve.ResolvedRunConfig`); rewritten on resume."""
    write_text_atomically(run_dir / RESOLVED_CONFIG_FILE, resolved.to_json())


def create_run_dir(config: RunConfig) -> Path:
    """A fresh run directory; refuses one that already holds a run."""
    run_dir = Path(config.output.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"output.dir {str(run_dir)!r} already holds a run (metrics.jsonl); choose a new directory "
            "so nothing written before is overwritten, or pass --resume to continue it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / CONFIG_FILE, json.dumps(config_record(config), indent=2) + "\n")
    return run_dir


def reopen_run_dir(config: RunConfig) -> tuple[Path, RunCheckpoint]:
    """The run directory to resume and its newest complete checkpoint; checks the config matches."""
    if not config.output.dir:
        raise ConfigError("resume needs the run directory: set output.dir (or --out RUN_DIR)")
    run_dir = Path(config.output.dir)
    saved_file = run_dir / CONFIG_FILE
    if not saved_file.is_file():
        raise ConfigError(f"cannot resume {str(run_dir)!r}: it holds no run ({CONFIG_FILE} is missing)")
    differences = config_differences(json.loads(saved_file.read_text()), config_record(config))
    if differences:
        shown = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in differences[:8])
        raise ConfigError(
            f"cannot resume {str(run_dir)!r} with a different config ({shown}). A resumed run may only change "
            f"{', '.join(RESUMABLE_KEYS)}, the {', '.join(RESUMABLE_SECTIONS)} section and the trainer layout "
            "(train.parallel, train.compute.device); start a new run instead"
        )
    remove_stale_temporaries(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(
            f"cannot resume {str(run_dir)!r}: it has no complete checkpoint under checkpoints/ "
            "(output.save_every_steps writes them; a run that stops early writes one too)"
        )
    # The resumed run is the run now (its step count and output settings may have changed).
    write_text_atomically(saved_file, json.dumps(config_record(config), indent=2) + "\n")
    return run_dir, checkpoint


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) for every key a resume may not change.

    A setting added to TitanRL after the run was saved is absent from its record; it matches
    when the new value is that setting's default (what the saved run computed with). Keys renamed
    since (`titanrl.config.renamed`) are read under their new names.
    """
    defaults = _flatten(config_record(RunConfig()))
    # A record saved before the config had sections names its keys the old way.
    flat_saved = {current_key(key, defaults.keys()): value for key, value in _flatten(saved).items()}
    flat_current = _flatten(current)
    out = []
    for key in sorted(flat_saved.keys() | flat_current.keys()):
        if key.split(".")[0] in RESUMABLE_SECTIONS or key in RESUMABLE_KEYS or key.startswith(RESUMABLE_PREFIXES):
            continue
        old, new = flat_saved.get(key, defaults.get(key, "<absent>")), flat_current.get(key, "<absent>")
        if old != new:
            out.append((key, old, new))
    return out


def set_aside_after(run_dir: Path, step: int) -> dict[str, int]:
    """Moves metrics/rollouts rows of steps after `step` to `<file>.before-resume`.

    The resumed run writes those steps again, so the main files then read as one run; the
    rows of the interrupted attempt are kept, not deleted. Returns rows moved per file.
    """
    moved = {}
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        path = run_dir / name
        if not path.is_file():
            continue
        found = read_json_lines(path)
        keep = [line.text for line in found.lines if line.value.get("step", 0) <= step]
        later = [line.text for line in found.lines if line.value.get("step", 0) > step]
        if found.cut_short is not None:  # the crash's partial row belongs to the interrupted attempt
            later.append(found.cut_short)
        if later:
            with open(run_dir / f"{name}.before-resume", "a") as f:
                f.write("\n".join(later) + "\n")
                f.flush()
                os.fsync(f.fileno())
        write_text_atomically(path, "".join(line + "\n" for line in keep))
        moved[name] = len(later)
    return moved


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

