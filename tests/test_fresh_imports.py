"""The modules a fresh process imports first (a Ray actor's class, the CLI) import on their own.

An import cycle can hide in a test session, where some other module was imported first; a Ray
actor process imports its class's module first, in a fresh interpreter, and fails there.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ENTRY_MODULES = [
    "titanrl.trainer.trainer",  # the trainer actor (GRPOTrainer, one process or a rank)
    "titanrl.trainer.optimizer",
    "titanrl.trainer.trainer_group",
    "titanrl.rollout.worker",  # the rollout worker actor
    "titanrl.cli",
    "titanrl.commands.plan",
]


@pytest.mark.parametrize("module", ENTRY_MODULES)
def test_module_imports_in_a_fresh_interpreter(module: str) -> None:
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
