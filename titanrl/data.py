"""Prompt datasets: JSON-lines rows, shuffled per epoch, served in fixed-size batches."""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


from titanrl.config import RunConfig
from titanrl.errors import ConfigError
from titanrl.jsonl import read_json_lines


class DatasetError(ConfigError):
    """A dataset file cannot be used; the message names the file and line."""


def load_rows(path: str | Path, prompt_field: str = "prompt") -> list[dict[str, Any]]:
    """Reads a JSON-lines file (by `titanrl.jsonl`'s rule) whose every row is an object with a string `prompt_field`."""
    rows = []
    for line in read_json_lines(path, error=DatasetError).lines:
        row, lineno = line.value, line.number
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

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream: restoring it replays exactly the batches that would follow."""
        return {"rng": self.rng.getstate(), "order": list(self.order), "epoch": self.epoch, "rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rows"] != len(self.rows):
            raise DatasetError(
                f"the training data has {len(self.rows)} usable rows but the checkpoint was taken with "
                f"{state['rows']}: resume needs the same data.train_file"
            )
        self.rng.setstate(state["rng"])
        self.order, self.epoch = list(state["order"]), state["epoch"]

    def next_batch(self) -> list[dict[str, Any]]:
        batch = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
                self.epoch += 1
            batch.append(self.rows[self.order.pop()])
        return batch


def drop_overlong(
    rows: list[dict[str, Any]],
    count_tokens: Callable[[str], int],
    prompt_field: str,
    max_new_tokens: int,
    max_model_len: int,
    source: str,
    on_overlong: str = "drop",
) -> list[dict[str, Any]]:
    """Removes rows whose prompt cannot fit `max_new_tokens` more tokens in `max_model_len`.

    Such a prompt would make the engine raise mid-run; finding it here costs one tokenizer
    pass. With `on_overlong="error"` the first one is an error instead.
    """
    budget = max_model_len - max_new_tokens
    overlong = [i for i, row in enumerate(rows) if count_tokens(row[prompt_field]) > budget]
    if not overlong:
        return rows
    first = overlong[0]
    what = (
        f"{len(overlong)} of {len(rows)} rows of {source} have a prompt longer than {budget} tokens "
        f"(rollout.max_model_len {max_model_len} - max_new_tokens {max_new_tokens}); the first is row {first} "
        f"({count_tokens(rows[first][prompt_field])} tokens)"
    )
    if on_overlong == "error":
        raise DatasetError(f"{what}; raise rollout.max_model_len or shorten them (or set data.on_overlong='drop')")
    if len(overlong) == len(rows):
        raise DatasetError(f"{what}: no row is left; raise rollout.max_model_len")
    warnings.warn(f"dropping {what} (data.on_overlong='drop')", stacklevel=2)
    skip = set(overlong)
    return [row for i, row in enumerate(rows) if i not in skip]


def prompt_token_counter(checkpoint: str) -> Callable[[str], int]:
    """Counts a text prompt's tokens as vLLM does (the checkpoint's tokenizer, default specials)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return lambda text: len(tokenizer(text)["input_ids"])


def load_eval_rows(config: RunConfig, count_tokens: Callable[[str], int] | None = None) -> list[dict[str, Any]]:
    """The first eval.max_prompts usable rows of the eval file ([] without one); prompts too
    long for rollout.max_model_len are dropped (or an error, per data.on_overlong)."""
    dc, rc = config.data, config.rollout
    if not dc.eval_file:
        return []
    rows = load_rows(dc.eval_file, dc.prompt_field)
    if config.env.factory is None:  # an environment writes its own prompt in reset()
        count_tokens = count_tokens or prompt_token_counter(config.model.checkpoint)
        max_new_tokens = config.eval.max_new_tokens or rc.max_new_tokens
        rows = drop_overlong(rows, count_tokens, dc.prompt_field, max_new_tokens, rc.max_model_len,
                             f"data.eval_file {dc.eval_file!r}", dc.on_overlong)
    return rows[: config.eval.max_prompts]


def load_run_rows(config: RunConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval rows of a run, checked before any actor starts: prompts that cannot fit
    rollout.max_new_tokens in rollout.max_model_len never reach an engine."""
    dc, rc = config.data, config.rollout
    train_rows = load_rows(dc.train_file, dc.prompt_field)
    if config.env.factory is not None:
        # An environment writes the prompt itself in reset(); its episode budget bounds the context.
        return train_rows, load_eval_rows(config)
    count_tokens = prompt_token_counter(config.model.checkpoint)
    train_rows = drop_overlong(train_rows, count_tokens, dc.prompt_field, rc.max_new_tokens, rc.max_model_len,
                               f"data.train_file {dc.train_file!r}", dc.on_overlong)
    return train_rows, load_eval_rows(config, count_tokens)


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Writes rows as JSON lines (used by examples to materialize generated datasets)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
