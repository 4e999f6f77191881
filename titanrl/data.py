"""Prompt datasets: JSON-lines rows, shuffled per epoch, served in fixed-size batches."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


from titanrl.config import ConfigError


class DatasetError(ConfigError):
    """A dataset file cannot be used; the message names the file and line."""


def load_rows(path: str | Path, prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """Reads a JSON-lines file whose every row is an object with a string `prompt_field`."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno} is not valid JSON ({e})") from e
            if not isinstance(row, dict) or not isinstance(row.get(prompt_field), str):
                raise DatasetError(f"{path}:{lineno} needs a string field {prompt_field!r} (data.prompt_field)")
            if not row[prompt_field]:
                # Without a BOS token an empty prompt leaves nothing to predict the first token from.
                raise DatasetError(f"{path}:{lineno} has an empty {prompt_field!r}")
            rows.append(row)
    if not rows:
        raise DatasetError(f"{path} has no rows")
    return rows


class PromptStream:
    """Endless batches of rows; each epoch is a fresh seeded shuffle, so runs are reproducible."""

    def __init__(self, rows: list[dict[str, Any]], batch_size: int, seed: int) -> None:
        self.rows, self.batch_size, self.rng = rows, batch_size, random.Random(seed)
        self.order: list[int] = []
        self.epoch = -1

    def next_batch(self) -> list[dict[str, Any]]:
        batch = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            batch.append(self.rows[self.order.pop()])
        return batch


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Writes rows as JSON lines (used by examples to materialize generated datasets)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
