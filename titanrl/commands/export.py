"""`titanrl export RUN_DIR [--step N] [--merge] --hf OUT`: a run's policy as an HF checkpoint directory.

The policy comes from a training checkpoint (`checkpoints/step_N/trainer`, converted by
`titanrl.trainer.checkpoint.export_hf`) or from `final/`, the HF directory a completed run
writes after its last step (copied as is). A LoRA run's policy is written as its adapters in
PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, which `peft` loads onto the
base checkpoint), or with `--merge` as the full checkpoint with the adapters merged in.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from titanrl.atomic_io import replacing_directory
from titanrl.commands import CommandError
from titanrl.driver.loop import TRAINER_STATE as TRAINER_DIR  # the trainer's state dir inside a run checkpoint
from titanrl.rundir.checkpoints import RunCheckpointError, find_checkpoint, list_checkpoints

FINAL_DIR = "final"


@dataclass(frozen=True)
class RunPolicy:
    """One saved policy of a run."""

    step: int | None
    """Training step it was saved after; None when the run does not record it."""
    path: Path
    """An HF checkpoint directory (`final/`) or a trainer state directory (`step_N/trainer`)."""
    is_hf: bool
    """True for an HF directory (copy it), False for a trainer state (convert it)."""


def _final_step(run_dir: Path) -> int | None:
    """The step `final/` was written after: the run's last step (train.steps in its config.json)."""
    try:
        return int(json.loads((run_dir / "config.json").read_text())["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_run_policy(run_dir: str | os.PathLike, step: int | None = None) -> RunPolicy:
    """The policy of `step`, or the run's newest: `final/` unless a training checkpoint is later."""
    run = Path(run_dir)
    if not run.is_dir():
        raise CommandError(f"run directory {str(run)!r} does not exist")
    final = run / FINAL_DIR
    final_step = _final_step(run) if (final / "config.json").is_file() else None
    has_final = (final / "config.json").is_file()
    if step is None:
        checkpoints = list_checkpoints(run)
        if has_final and (final_step is None or not checkpoints or final_step >= checkpoints[-1].step):
            return RunPolicy(final_step, final, True)
        if not checkpoints:
            raise CommandError(
                f"{str(run)!r} has no training checkpoint (checkpoints/step_N/) and no final policy "
                f"({FINAL_DIR}/): nothing to export (is it a run directory?)"
            )
        newest = checkpoints[-1]
        return RunPolicy(newest.step, newest.path / TRAINER_DIR, False)
    try:
        found = find_checkpoint(run, step)
    except RunCheckpointError as e:
        if has_final and final_step == step:
            return RunPolicy(step, final, True)
        raise CommandError(str(e)) from None
    return RunPolicy(found.step, found.path / TRAINER_DIR, False)


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """`out_dir` as a Path, refusing a file or a non-empty directory (nothing is overwritten)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CommandError(f"output {str(out)!r} already exists and is not an empty directory; choose a new path")
    return out


def write_hf(policy_path: str | os.PathLike, is_hf: bool, out_dir: str | os.PathLike) -> Path:
    """Writes an HF directory at `out_dir` from a trainer state (converted; a LoRA policy merged)
    or an HF directory (copied, without a LoRA run's `adapter/`).

    It is written under a temporary sibling name and renamed into place when complete.
    """
    out = check_output_dir(out_dir)
    if not is_hf:
        from titanrl.trainer.checkpoint import export_hf

        return export_hf(policy_path, out)  # written through replacing_directory, as below
    from titanrl.models.peft_adapter import EXPORT_ADAPTER_DIR

    with replacing_directory(out) as tmp:  # an existing `out` is empty (checked above)
        shutil.copytree(policy_path, tmp, dirs_exist_ok=True, ignore=_top_level(policy_path, EXPORT_ADAPTER_DIR))
    return out


def _top_level(root: str | os.PathLike, name: str):  # noqa: ANN202 (a copytree ignore callable)
    return lambda d, names: [name] if Path(d) == Path(root) and name in names else []


def is_lora_policy(policy: RunPolicy) -> bool:
    """Whether the policy carries LoRA adapters (a LoRA run's `final/` keeps them in `adapter/`)."""
    if policy.is_hf:
        from titanrl.models.peft_adapter import ADAPTER_CONFIG, EXPORT_ADAPTER_DIR

        return (policy.path / EXPORT_ADAPTER_DIR / ADAPTER_CONFIG).is_file()
    from titanrl.trainer.checkpoint import lora_record

    return lora_record(policy.path) is not None


def write_peft_adapter(policy: RunPolicy, out_dir: str | os.PathLike) -> Path:
    """Writes a LoRA policy's adapters at `out_dir` as a PEFT adapter directory."""
    out = check_output_dir(out_dir)
    if not policy.is_hf:
        from titanrl.trainer.checkpoint import export_peft_adapter

        return export_peft_adapter(policy.path, out)
    from titanrl.models.peft_adapter import EXPORT_ADAPTER_DIR

    with replacing_directory(out) as tmp:
        shutil.copytree(policy.path / EXPORT_ADAPTER_DIR, tmp, dirs_exist_ok=True)
    return out


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None,
               merge: bool = False) -> RunPolicy:
    """`titanrl export`: writes the run's newest (or step `step`) policy to `out_dir` as an HF checkpoint;
    a LoRA run's as a PEFT adapter directory unless `merge` (then the merged full checkpoint)."""
    check_output_dir(out_dir)
    policy = find_run_policy(run_dir, step)
    if not merge and is_lora_policy(policy):
        write_peft_adapter(policy, out_dir)
    else:
        write_hf(policy.path, policy.is_hf, out_dir)
    return policy
