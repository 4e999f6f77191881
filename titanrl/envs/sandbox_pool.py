"""A pool of pre-started sandboxes for running many episodes' code concurrently.

Pre-warming is real: each slot is a live bubblewrap sandbox whose runner already paid for the
namespaces, mounts and its own Python start, so a call costs one fork + exec of the untrusted
program (see benchmarks/sandbox_pool.py for the measured ratio). Every call still starts clean:
the runner gives each program fresh tmpfs mounts and IPC namespace and kills every process it
left behind. A slot whose runner dies or hangs is replaced by a freshly started sandbox.
"""

from __future__ import annotations

import asyncio

from titanrl.envs.sandbox import Sandbox, SandboxConfig, SandboxResult


class SandboxPool:
    """`async with SandboxPool(size=4) as pool: result = await pool.run(code)`.

    At most `size` programs run at once; further calls wait for a free slot without blocking
    the event loop.
    """

    def __init__(self, size: int = 4, config: SandboxConfig | None = None) -> None:
        if size < 1:
            raise ValueError(f"SandboxPool size must be >= 1, got {size}")
        self.size = size
        self.config = config or SandboxConfig()
        self._idle: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._all: set[Sandbox] = set()
        self.restarts = 0
        """How many slots were replaced after their runner failed (for metrics)."""

    async def _new_sandbox(self) -> Sandbox:
        sandbox = Sandbox(self.config)
        self._all.add(sandbox)
        try:
            await sandbox.start()
        except BaseException:
            self._all.discard(sandbox)
            raise
        return sandbox

    async def start(self) -> None:
        """Start all slots concurrently; raises SandboxUnavailableError if any cannot start."""
        results = await asyncio.gather(*(self._new_sandbox() for _ in range(self.size)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        for sandbox in results:
            self._idle.put_nowait(sandbox)

    async def run(self, code: str, *, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        """Run `code` in the next free sandbox; same contract as `run_python`."""
        sandbox = await self._idle.get()
        try:
            if sandbox.broken:  # Replace lazily, so a failure costs only the call that meets it.
                self._all.discard(sandbox)
                self.restarts += 1
                sandbox = await self._new_sandbox()
            return await sandbox.run(code, stdin=stdin, timeout_s=timeout_s)
        finally:
            self._idle.put_nowait(sandbox)

    async def close(self) -> None:
        """Stop every sandbox (and with it every process inside)."""
        await asyncio.gather(*(s.close() for s in self._all))
        self._all.clear()

    async def __aenter__(self) -> SandboxPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
