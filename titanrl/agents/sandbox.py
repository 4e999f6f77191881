"""The one thing an agent file takes from titanrl: the rollout worker's code sandbox.

    from titanrl.agents import episode_sandbox

    async def agent(base_url, api_key, row):
        sandbox = episode_sandbox()
        output = await sandbox.run_python("print(6 * 7)")   # a sync agent: sandbox.run_python_sync(...)

Inside an episode (the agent function's own task or thread), `episode_sandbox()` returns a handle
to the worker's pre-started bubblewrap `SandboxPool` (`agent.sandbox_pool_size` slots). The
handle is found through a context variable the runner sets for each episode; asyncio tasks and
`asyncio.to_thread` carry it along, so any code the agent runs reaches it.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from titanrl.envs.code_exec import PythonTool


class EpisodeSandbox:
    """`run_python(code)` in the worker's sandbox pool, from an async agent or (`run_python_sync`) a sync one."""

    def __init__(self, pool: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0) -> None:
        self._tool = PythonTool(pool, timeout_s=timeout_s)
        self._loop = loop
        self.sandbox_s = 0.0
        """Seconds this episode's programs ran."""

    async def run_python(self, code: str) -> str:
        """Runs a Python program in a fresh sandbox; returns its stdout, stderr and exit status as text."""
        try:
            return await self._tool.run_python(code)
        finally:
            self.sandbox_s = self._tool.stats.sandbox_s

    def run_python_sync(self, code: str) -> str:
        """`run_python` for a sync agent (it runs in a thread of its own): waits on the worker's loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("run_python_sync was called on the worker's event loop: an async agent awaits "
                               "run_python instead")
        return asyncio.run_coroutine_threadsafe(self.run_python(code), self._loop).result()


_CURRENT: contextvars.ContextVar[EpisodeSandbox | None] = contextvars.ContextVar("titanrl_episode_sandbox",
                                                                                   default=None)


def episode_sandbox() -> EpisodeSandbox:
    """The running episode's sandbox; raises with what to set when the run has none."""
    sandbox = _CURRENT.get()
    if sandbox is None:
        raise RuntimeError("episode_sandbox() found no sandbox: call it inside an agent episode of a run with "
                           "agent.sandbox_pool_size >= 1 (and bubblewrap installed: make system-deps)")
    return sandbox


def set_episode_sandbox(sandbox: EpisodeSandbox | None) -> contextvars.Token:
    """(The runner.) Makes `sandbox` what `episode_sandbox()` returns in the current context."""
    return _CURRENT.set(sandbox)
