"""Agentic environments: the code-execution sandbox (more environments build on it)."""

from titanrl.envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
    run_python,
    run_python_async,
)
from titanrl.envs.sandbox_pool import SandboxPool

__all__ = [
    "Sandbox",
    "SandboxConfig",
    "SandboxPool",
    "SandboxResult",
    "SandboxUnavailableError",
    "run_python",
    "run_python_async",
]
