"""Prompt datasets: rows from files or memory (through `datasets`), checked, shuffled per epoch,
served in fixed-size batches.

A source is a path or rows in memory:

- `.jsonl`: JSON lines, read by `titanrl.jsonl`'s rule (errors name file:line);
- `.json`, `.parquet`, `.csv`: read by `datasets.load_dataset` (a glob such as
  `/data/gsm8k/train-*.parquet` reads every matching file, in sorted order);
- a directory written by `Dataset.save_to_disk` (`datasets.load_from_disk`);
- in Python, a list of dicts or a `datasets.Dataset` (`DataConfig.train_rows` / `eval_rows`).

Every row must be an object with a non-empty string `data.prompt_field`, or, with
`data.messages_field` set, a non-empty list of `{"role", "content"}` messages there (or a
string: one user message); the first row that is not fails with its index and the missing field
before any actor starts. Message rows (after `data.system_prompt`, when set) are rendered with
the checkpoint tokenizer's chat template (`titanrl.chat.render_chat`) into `prompt_field`, so
workers and rewards see prompt text as for any other row.
"""

from __future__ import annotations

import glob
import json
import os
import random
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


from titanrl.chat import render_chat
from titanrl.config import RunConfig
from titanrl.errors import ConfigError
from titanrl.jsonl import read_json_lines

DATASETS_FORMATS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffixes read through `datasets.load_dataset`, and the builder each one uses."""


class DatasetError(ConfigError):
    """A dataset cannot be used; the message names the source and the row."""


def read_source(source: Any, label: str) -> tuple[list[Any], Callable[[int], str]]:
    """The raw rows of a source (see the module docstring) and how to name row i in a message."""
    if isinstance(source, (list, tuple)):
        return list(source), lambda i: f"{label} row {i}"
    if not isinstance(source, (str, os.PathLike)):
        import datasets

        if isinstance(source, datasets.DatasetDict):
            raise DatasetError(f"{label} is a DatasetDict with splits {sorted(source)}: pass one split, "
                               f"e.g. dataset[{sorted(source)[0]!r}]")
        if not isinstance(source, datasets.Dataset):
            raise DatasetError(f"{label} must be a path, a list of dicts or a datasets.Dataset, "
                               f"got {type(source).__name__}")
        return source.to_list(), lambda i: f"{label} row {i}"
    path = str(source)
    if Path(path).is_dir():
        return _read_saved_dataset(path), lambda i: f"{path} row {i}"
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        lines = read_json_lines(path, error=DatasetError).lines
        return [line.value for line in lines], lambda i: f"{path}:{lines[i].number}"
    if suffix in DATASETS_FORMATS:
        return _read_with_datasets(DATASETS_FORMATS[suffix], path), lambda i: f"{path} row {i}"
    raise DatasetError(f"{path!r}: unknown data format {suffix or '(no suffix)'!r}; use .jsonl, .json, .parquet, "
                       ".csv or a directory written by datasets.Dataset.save_to_disk")


def source_files(path: str) -> list[str]:
    """The files a path names: itself, or the sorted matches of a glob pattern ([] when none)."""
    if glob.has_magic(path):
        return sorted(p for p in glob.glob(path) if Path(p).is_file())
    return [path] if Path(path).is_file() else []


def _read_with_datasets(builder: str, path: str) -> list[dict[str, Any]]:
    files = source_files(path)
    if not files:
        raise DatasetError(f"{path!r} matches no file")
    import datasets

    # A private cache: the rows are materialised below, so nothing needs to outlive this call.
    with tempfile.TemporaryDirectory(prefix="titanrl-data-") as cache:
        try:
            dataset = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache)
        except Exception as e:  # noqa: BLE001 - the reader's own message says what is wrong
            raise DatasetError(f"{path!r} cannot be read as {builder}: {type(e).__name__}: {e}") from e
        return dataset.to_list()


def _read_saved_dataset(path: str) -> list[dict[str, Any]]:
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise DatasetError(f"{path!r} is a directory but not one written by datasets.Dataset.save_to_disk "
                           f"({e}); point at the data files instead") from e
    if isinstance(dataset, datasets.DatasetDict):
        raise DatasetError(f"{path!r} holds a DatasetDict with splits {sorted(dataset)}: point at one split's "
                           f"directory, e.g. {str(Path(path) / sorted(dataset)[0])!r}")
    return dataset.to_list()


def check_rows(rows: list[Any], where: Callable[[int], str], prompt_field: str, messages_field: str = "") -> None:
    """Raises DatasetError for the first row that cannot become a prompt, naming it and the field."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{where(i)} must be an object (a dict), got {type(row).__name__}")
        if messages_field:
            _check_messages(row, where(i), messages_field)
            continue
        if not isinstance(row.get(prompt_field), str):
            raise DatasetError(f"{where(i)} needs a string field {prompt_field!r} (data.prompt_field)")
        if not row[prompt_field]:
            # Without a BOS token an empty prompt leaves nothing to predict the first token from.
            raise DatasetError(f"{where(i)} has an empty {prompt_field!r}")


def _check_messages(row: dict[str, Any], where: str, messages_field: str) -> None:
    messages = row.get(messages_field)
    if isinstance(messages, str) and messages:
        return  # one user message (a GSM8K `question`, say)
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where} needs a field {messages_field!r} (data.messages_field) holding a non-empty "
                           f"list of {{'role', 'content'}} messages (or a non-empty string: one user message), got {'nothing' if messages is None else repr(messages)[:80]}")
    for j, message in enumerate(messages):
        for key in ("role", "content"):
            if not isinstance(message, dict) or not isinstance(message.get(key), str):
                raise DatasetError(f"{where}: message {j} of {messages_field!r} needs a string field {key!r}")


def load_rows(source: Any, prompt_field: str = "prompt", messages_field: str = "",
              label: str | None = None) -> list[dict[str, Any]]:
    """The checked rows of a source (a path, a list of dicts or a `datasets.Dataset`); `label`
    names an in-memory source in messages (the config field it came from)."""
    label = label or (str(source) if isinstance(source, (str, os.PathLike)) else "the rows")
    rows, where = read_source(source, label)
    if not rows:
        raise DatasetError(f"{label} has no rows")
    check_rows(rows, where, prompt_field, messages_field)
    return rows


def row_messages(value: str | list[dict[str, Any]], system_prompt: str = "") -> list[dict[str, Any]]:
    """The chat messages of a row's `messages_field` value: a string is one user message; a
    `system_prompt` goes first unless the messages start with a system message of their own."""
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else list(value)
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_messages(rows: list[dict[str, Any]], tokenizer: Any, messages_field: str,
                    prompt_field: str, system_prompt: str = "") -> list[dict[str, Any]]:
    """Rows with `prompt_field` set to their messages under the tokenizer's chat template
    (ChatML for a tokenizer without one); the messages stay in the row for the rewards."""
    return [{**row, prompt_field: render_chat(tokenizer, row_messages(row[messages_field], system_prompt))}
            for row in rows]


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
                f"{state['rows']}: resume needs the same data.train_file (or data.train_rows)"
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
        f"(rollout.engine.max_model_len {max_model_len} - max_new_tokens {max_new_tokens}); the first is row {first} "
        f"({count_tokens(rows[first][prompt_field])} tokens)"
    )
    if on_overlong == "error":
        raise DatasetError(
            f"{what}; raise rollout.engine.max_model_len or shorten them (or set data.on_overlong='drop')"
        )
    if len(overlong) == len(rows):
        raise DatasetError(f"{what}: no row is left; raise rollout.engine.max_model_len")
    warnings.warn(f"dropping {what} (data.on_overlong='drop')", stacklevel=2)
    skip = set(overlong)
    return [row for i, row in enumerate(rows) if i not in skip]


def load_tokenizer(checkpoint: str) -> Any:
    """The checkpoint's tokenizer, as vLLM loads it (its chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def prompt_token_counter(checkpoint: str, tokenizer: Any = None) -> Callable[[str], int]:
    """Counts a text prompt's tokens as vLLM does (the checkpoint's tokenizer, default specials)."""
    tokenizer = tokenizer or load_tokenizer(checkpoint)
    return lambda text: len(tokenizer(text)["input_ids"])


def _source(rows: Any, file: str, name: str) -> tuple[Any, str]:
    """The configured source of one split: in-memory rows (data.{name}_rows) win over the file."""
    return (rows, f"data.{name}_rows") if rows is not None else (file, file)


def _prompts(config: RunConfig, rows: list[dict[str, Any]], tokenizer: Any, max_new_tokens: int,
             source: str) -> list[dict[str, Any]]:
    """Rows with their prompt text rendered (data.messages_field) and too-long prompts dropped."""
    dc, rc = config.data, config.rollout
    if dc.messages_field:
        rows = render_messages(rows, tokenizer, dc.messages_field, dc.prompt_field, dc.system_prompt)
    count_tokens = prompt_token_counter(config.model.checkpoint, tokenizer)
    return drop_overlong(rows, count_tokens, dc.prompt_field, max_new_tokens, rc.engine.max_model_len, source,
                         dc.on_overlong)


def load_eval_rows(config: RunConfig, tokenizer: Any = None) -> list[dict[str, Any]]:
    """The first eval.max_prompts usable rows of the eval source ([] without one); prompts too
    long for rollout.engine.max_model_len are dropped (or an error, per data.on_overlong)."""
    dc = config.data
    if dc.eval_rows is None and not dc.eval_file:
        return []
    source, label = _source(dc.eval_rows, dc.eval_file, "eval")
    env = config.runs_episodes  # an environment (in reset()) or an agent writes its own prompt
    rows = load_rows(source, dc.prompt_field, "" if env else dc.messages_field, label)
    if not env:
        max_new_tokens = config.eval.max_new_tokens or config.rollout.sampling.max_new_tokens
        rows = _prompts(config, rows, tokenizer or load_tokenizer(config.model.checkpoint), max_new_tokens,
                        f"data.eval_file {label!r}" if dc.eval_rows is None else label)
    return rows[: config.eval.max_prompts]


def load_run_rows(config: RunConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval rows of a run, checked before any actor starts: every row has a prompt (or
    messages), and prompts that cannot fit rollout.sampling.max_new_tokens in rollout.engine.max_model_len never
    reach an engine."""
    dc = config.data
    source, label = _source(dc.train_rows, dc.train_file, "train")
    if config.runs_episodes:
        # An environment (in reset()) or an agent writes the prompt itself; each call fits the context.
        return load_rows(source, dc.prompt_field, label=label), load_eval_rows(config)
    train_rows = load_rows(source, dc.prompt_field, dc.messages_field, label)
    tokenizer = load_tokenizer(config.model.checkpoint)
    train_rows = _prompts(config, train_rows, tokenizer, config.rollout.sampling.max_new_tokens,
                          f"data.train_file {label!r}" if dc.train_rows is None else label)
    return train_rows, load_eval_rows(config, tokenizer)


def longest_prompt_tokens(config: RunConfig, rows: list[dict[str, Any]]) -> int | None:
    """Tokens of the longest prompt among `rows` (rendered, as `load_run_rows` returns them), counted
    in batches by the checkpoint's tokenizer; None for environment runs (the environment writes
    the prompt) or no rows. The memory plan sizes sequences by it."""
    if config.runs_episodes or not rows:
        return None
    tokenizer = load_tokenizer(config.model.checkpoint)
    texts = [row[config.data.prompt_field] for row in rows]
    return max(max(len(ids) for ids in tokenizer(texts[i : i + 4096])["input_ids"]) for i in range(0, len(texts), 4096))


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Writes rows as JSON lines (used by examples to materialize generated datasets)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
