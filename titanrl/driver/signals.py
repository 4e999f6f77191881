"""SIGTERM handled as Ctrl-C is: what SLURM, Kubernetes and `kill` send on preemption.

Ray's driver handler turns SIGTERM into `sys.exit`, which Ray's own `ray.get` rewraps and the
process then aborts halfway through saving. Here SIGTERM raises `KeyboardInterrupt` instead (the
one exception `ray.get` passes through as it is), and `received` tells the driver it was SIGTERM,
so the run saves its last completed step, shuts its actors down and exits with status 143.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("titanrl")


class SigtermAsInterrupt:
    """While installed, the first SIGTERM raises KeyboardInterrupt; later ones only say the run is stopping.

    Later ones are not raised: they would cut the checkpoint write or the actor shutdown the
    first one started (a scheduler that will not wait sends SIGKILL anyway).
    """

    def __init__(self) -> None:
        self.received = False
        """Whether SIGTERM arrived while installed."""
        self._previous: Any = None
        self._installed = False

    def install(self) -> SigtermAsInterrupt:
        """Takes over SIGTERM (only possible in the main thread; elsewhere the handler stays as it is)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def uninstall(self) -> None:
        """Puts the previous SIGTERM handler back."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            log.info("SIGTERM again: already stopping (saving the last completed step, shutting down)")
            return
        self.received = True
        raise KeyboardInterrupt
