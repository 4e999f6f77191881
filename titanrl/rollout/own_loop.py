"""The event loop an episode runner keeps for blocking callers (a lock-step worker's `generate`
and `evaluate`).

A runner's resources (sandboxes, an agent endpoint) belong to the loop that started them: their
pipes and sockets are that loop's. A continuous worker starts them on its actor's loop
(`await runner.start()`) and calls the async methods there; a lock-step worker calls the blocking
ones, which run everything on the runner's own loop, made once and kept for the runner's life.
"""

from __future__ import annotations

import asyncio
from typing import Any


class OwnLoop:
    """Mixin for `EnvRunner` and `AgentRunner`: they define `started` and `start()`."""

    loop: asyncio.AbstractEventLoop | None = None
    """The runner's own event loop (None until a blocking call needs it)."""

    @property
    def started(self) -> bool:
        """Whether `start()` has run (on whichever loop)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Starts the runner's resources on the running loop; idempotent."""
        raise NotImplementedError

    def start_blocking(self) -> None:
        """Makes the runner's own loop and starts the resources on it, so a worker that cannot run
        them fails at start-up."""
        if self.loop is None:
            if self.started:
                raise RuntimeError(f"{type(self).__name__} was started on an event loop (`start`): use its async "
                                   "methods (generate_group, evaluate_async) there")
            self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.start())

    def run_blocking(self, coroutine: Any) -> Any:
        """`coroutine` to completion on the runner's own loop."""
        if self.loop is None:
            self.start_blocking()
        assert self.loop is not None
        return self.loop.run_until_complete(coroutine)

    def close_loop(self, stop: Any) -> None:
        """Runs `stop` (the coroutine that stops the resources) on the runner's own loop, if it
        has one, and closes the loop; an async caller awaits its own stop first."""
        if self.loop is not None:
            self.loop.run_until_complete(stop)
            self.loop.close()
        else:
            stop.close()  # never awaited: nothing ran on a loop of ours
