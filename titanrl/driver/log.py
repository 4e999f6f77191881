"""The driver's progress messages: `logging.getLogger("titanrl")` at INFO level.

`train()` calls `show_messages()`, which prints them on stderr as `[titanrl] message`, as the
driver always has, unless the application has configured the "titanrl" logger itself (given it
handlers): then they go only where it says.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "titanrl"
FORMAT = "[titanrl] %(message)s"

logger = logging.getLogger(LOGGER_NAME)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a message is emitted (a redirect, pytest's capture),
    flushing each message, as `print(..., file=sys.stderr, flush=True)` does."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


def show_messages() -> None:
    """Shows the "titanrl" logger's INFO messages on stderr as `[titanrl] message`, once per
    process; leaves a logger the application has configured (any handler of its own) alone."""
    if logger.handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, as before, even where the root logger has handlers
