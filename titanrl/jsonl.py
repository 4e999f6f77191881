"""Reading JSON-lines files (datasets, metrics.jsonl, rollouts.jsonl): the one reader and its rule.

The rule, the same for every file TitanRL reads:

- blank lines are skipped;
- the LAST line, when it has no newline after it and is not valid JSON, is what a crash leaves
  mid-write (appends write a whole line then flush, so only the tail can be cut short): it is
  skipped with a warning naming the file and line;
- any other line that is not valid JSON is an error naming the file and line number (nothing
  a crash does produces it, so it is damage a person must look at).

A leaf module (standard library only).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("titanrl")


class JsonLinesError(ValueError):
    """A JSON-lines file has a line that is not JSON (not a crash's cut-short tail); names file and line."""


@dataclass(frozen=True)
class JsonLine:
    """One parsed line of a JSON-lines file."""

    number: int
    """1-based line number in the file (for messages that point at it)."""
    value: Any
    """The parsed JSON value."""
    text: str
    """The line as written, without its newline (to copy it elsewhere unchanged)."""


@dataclass(frozen=True)
class JsonLines:
    """What `read_json_lines` found in a file."""

    lines: list[JsonLine]
    """Every valid JSON line, in file order."""
    cut_short: str | None
    """The crash's incomplete last line that was skipped (with a warning), or None."""

    def values(self) -> list[Any]:
        """The parsed values of `lines`."""
        return [line.value for line in self.lines]


def read_json_lines(path: str | os.PathLike, error: Callable[[str], Exception] = JsonLinesError) -> JsonLines:
    """The JSON lines of `path` by the module's rule; `error(message)` is raised for a bad line."""
    path = Path(path)
    lines = path.read_text().split("\n")
    # A file ending in a newline splits into an empty string last; otherwise its last line has none.
    unterminated = len(lines) - 1 if lines[-1] else None
    found, cut_short = [], None
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            if index == unterminated:
                log.warning("%s:%d: skipping an incomplete last line (a write cut short by a crash)", path, index + 1)
                cut_short = line
                continue
            raise error(f"{path}:{index + 1} is not valid JSON ({e}); fix or remove that line") from e
        found.append(JsonLine(index + 1, value, line))
    return JsonLines(found, cut_short)
