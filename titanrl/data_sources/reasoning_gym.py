"""Prompt rows from `reasoning-gym`'s procedural tasks (chain_sum, gsm_symbolic, basic_arithmetic, ...).

    from titanrl.data_sources.reasoning_gym import reasoning_gym_data
    from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format

    config = titanrl.RunConfig(
        data=reasoning_gym_data("chain_sum", {"min_terms": 2, "max_terms": 4}, seed=0,
                                train_size=2000, eval_size=200),  # answer_format="last_line": `Answer: N`
        rewards=[reasoning_gym_answer, reasoning_gym_format], reward_weights=[1.0, 0.1], ...)

A task name, its config (keyword arguments of the task's reasoning-gym config dataclass, e.g.
`ChainSumConfig`), a seed and two sizes give the train and held-out rows as `datasets.Dataset`s:

- one reasoning-gym dataset of `train_size + eval_size` entries at `seed` is generated; entries
  `0 .. train_size-1` are the training rows and the rest the held-out ones. Many tasks
  (chain_sum, basic_arithmetic) seed entry i with `seed + i`, so seeds `s` and `s + 1` share all
  but one entry: splitting one dataset by index, not by seed, keeps the two splits apart;
- a held-out entry whose question is also a training question is then dropped (small task
  configs repeat questions), with one warning giving the count;
- the same arguments give the same rows, in any process.

Each row (every field a plain string but `messages`, so rows keep one schema through Arrow,
Parquet and JSON lines):

    messages     [{"role": "user", "content": question + "\\n\\n" + ANSWER_INSTRUCTIONS[answer_format]}]
    question     the task's question
    answer       the task's reference answer (None for tasks whose checker needs none)
    task         the reasoning-gym task name
    task_config  the config keys given plus seed and size, as JSON (the reward rebuilds the task's
                 config dataclass from them, so its checker sees the config of generation)
    metadata     the entry's metadata, as JSON (`titanrl.data_sources.plain_json`: tuples kept)
    answer_format  the answer convention the prompt asked for: "tags" or "last_line"

`reasoning_gym_data` puts them in a `DataConfig` with `messages_field="messages"`, so prompts
are rendered with the checkpoint's chat template.

The answer convention is chosen once per source (`answer_format=`) and travels in every row, so
the rewards (`titanrl.rewards.reasoning_gym`) read what the prompt asked for:

- "tags" (the default; reasoning-gym's own): the instruction `ANSWER_INSTRUCTION` asks for the
  final answer between `<answer>` and `</answer>`; the answer is the stripped text of the
  completion's last `<answer>...</answer>` block (`tag_answer`, as
  `reasoning_gym.utils.extract_answer`).
- "last_line": the instruction `LAST_LINE_INSTRUCTION` asks for a final line `Answer: <answer>`
  (small chat models follow it where they ignore the tags; examples/reasoning/). `last_line_answer`
  reads the completion's last *answer line*: a line (split by `str.splitlines`) that starts, after
  optional whitespace and asterisks (markdown bold/italic, `**`), with `answer` in any case,
  optional whitespace and asterisks, then `:` (so `Answer: 42`, `answer:42`, `ANSWER : 42`,
  `**Answer:** 42`, `**Answer**: 42`, `*Answer:* 42`, `**Answer: 42**`; not `The answer is 42`,
  `Final answer: 42`, `Answer - 42`, nor `... so Answer: 42` in the middle of a line). Its answer
  is the rest of the line with surrounding whitespace and asterisks removed, then, if it ends
  with `.`, that one `.` and the whitespace and asterisks before it (`**42**.`, `42.`, `**42.**`
  and ` 42 ` all give `42`; `3.5` stays `3.5`); an empty rest is no answer (None). Text after the answer line is
  allowed by the answer reward (as text after `</answer>` is), not by the format reward.

Errors are `ConfigError`s raised when the rows are built, before any config is validated or
actor started, naming the argument at fault: `task` (an unknown name, with close matches),
`config['key']` (a key the task's config does not have, a value of the wrong type, or one its
`validate()` rejects), `seed`, `train_size`, `eval_size`, `answer_format` (not one of
`ANSWER_FORMATS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any

from titanrl.data_sources import plain_json
from titanrl.errors import ConfigError

ANSWER_INSTRUCTION = ("Think step by step if it helps, then give only your final answer between <answer> and "
                      "</answer> tags, as the last thing you write: <answer>your final answer</answer>")
"""Appended to every question: the answer convention that `final_answer` reads (reasoning-gym's own)."""

LAST_LINE_INSTRUCTION = ("Think step by step if it helps, then end your reply with a final line of the form "
                         "\"Answer: <answer>\", giving only your final answer after \"Answer:\".")
"""Appended to every question under answer_format="last_line": the convention `last_line_answer` reads."""

ANSWER_INSTRUCTIONS = {"tags": ANSWER_INSTRUCTION, "last_line": LAST_LINE_INSTRUCTION}
"""The instruction of each answer convention."""

ANSWER_FORMATS = tuple(ANSWER_INSTRUCTIONS)
"""The answer conventions (`answer_format=`): "tags" (the default) and "last_line"."""

DEFAULT_ANSWER_FORMAT = "tags"
"""The convention of rows that name none (rows written before the field existed)."""

ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
"""An answer block; the same pattern as `reasoning_gym.utils.extract_answer` (which imports the whole package)."""

ANSWER_LINE = re.compile(r"\s*\**\s*answer\s*\**\s*:", re.IGNORECASE)
"""The start of an answer line under "last_line" (`re.match`ed against each line; see the module docstring)."""

RESERVED_KEYS = ("seed", "size")
"""Task config keys this module sets itself (from the `seed`, `train_size` and `eval_size` arguments)."""

UNSUPPORTED_TASKS = {"composite": "mix tasks by concatenating the rows of several sources instead "
                                  "(each row names its own task)"}
"""Registered reasoning-gym datasets that are not single tasks, and what to do instead."""


def tag_answer(completion: str) -> str | None:
    """The stripped text of the completion's last `<answer>...</answer>` block, or None when it has
    none (as `reasoning_gym.utils.extract_answer`)."""
    matches = ANSWER_TAG.findall(completion)
    return matches[-1].strip() if matches else None


def answer_lines(completion: str) -> list[tuple[int, str]]:
    """`(line index, answer text)` of every answer line of the completion (see the module
    docstring), in order; the text may be empty."""
    found = []
    for index, line in enumerate(completion.splitlines()):
        start = ANSWER_LINE.match(line)
        if start is None:
            continue
        text = line[start.end():].strip().strip("*").strip()
        if text.endswith("."):
            text = text[:-1].rstrip().rstrip("*").rstrip()
        found.append((index, text))
    return found


def last_line_answer(completion: str) -> str | None:
    """The answer of the completion's last answer line (`Answer: 42` gives "42"; the module
    docstring lists what is accepted), or None when it has none or that answer is empty."""
    found = answer_lines(completion)
    return (found[-1][1] or None) if found else None


def check_answer_format(answer_format: Any, name: str = "answer_format") -> str:
    """`answer_format` when it is one of `ANSWER_FORMATS`; a ConfigError naming `name` otherwise."""
    if not isinstance(answer_format, str) or answer_format not in ANSWER_FORMATS:
        raise ConfigError(f"reasoning_gym {name} must be one of {', '.join(map(repr, ANSWER_FORMATS))}, "
                          f"got {answer_format!r}")
    return answer_format


def final_answer(completion: str, answer_format: str = DEFAULT_ANSWER_FORMAT) -> str | None:
    """The completion's final answer under `answer_format` ("tags": `tag_answer`, "last_line":
    `last_line_answer`), or None when it gives none; a ValueError for an unknown convention."""
    if answer_format == "tags":
        return tag_answer(completion)
    if answer_format == "last_line":
        return last_line_answer(completion)
    raise ValueError(f"answer_format {answer_format!r} is not one of {', '.join(map(repr, ANSWER_FORMATS))}")


def task_names() -> list[str]:
    """The names of the reasoning-gym tasks this source serves, sorted."""
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name not in UNSUPPORTED_TASKS)


def check_task(task: Any) -> None:
    """Raises ConfigError naming `task` when it is not a reasoning-gym task name."""
    if not isinstance(task, str):
        raise ConfigError(f"reasoning_gym task must be a task name (a string), got {type(task).__name__}")
    if task in UNSUPPORTED_TASKS:
        raise ConfigError(f"reasoning_gym task {task!r} is not a single task: {UNSUPPORTED_TASKS[task]}")
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ConfigError(f"reasoning_gym task {task!r} is not a reasoning-gym task; {hint}"
                          f"the {len(names)} tasks: {', '.join(names)}")


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether `value` fits a simple annotation (int, float, bool, str, Optional/unions of them);
    other annotations (tuples, lists, nested configs) are left to the config's own `validate()`."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        return any(_type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def task_config(task: str, config: Mapping[str, Any] | None, seed: int, size: int) -> Any:
    """The task's reasoning-gym config dataclass from `config` plus `seed` and `size`, validated;
    ConfigError names `config['key']` for an unknown key, a value of the wrong type or a value
    the config's `validate()` rejects."""
    from reasoning_gym.factory import DATASETS

    check_task(task)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"reasoning_gym config must be a dict of {task!r}'s config fields, "
                          f"got {type(config).__name__}")
    config_cls = DATASETS[task][1]
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved is just not type-checked
        hints = {}
    for key, value in config.items():
        if key in RESERVED_KEYS:
            raise ConfigError(f"reasoning_gym config[{key!r}] is set by the source itself "
                              f"(the seed, train_size and eval_size arguments): remove it")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            own = ", ".join(k for k in fields if k not in RESERVED_KEYS)
            raise ConfigError(f"reasoning_gym config[{key!r}] is not a field of {task!r}'s "
                              f"{config_cls.__name__}; {hint}its fields: {own}")
        if key in hints and not _type_ok(value, hints[key]):
            raise ConfigError(f"reasoning_gym config[{key!r}] = {value!r} for task {task!r}: expected "
                              f"{getattr(hints[key], '__name__', hints[key])}, got {type(value).__name__}")
    try:
        built = config_cls(**config, seed=seed, size=size)
        if hasattr(built, "validate"):
            built.validate()
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        # The key the message names first (validate() messages start with the field they check).
        found = [(m.start(), k) for k in config if (m := re.search(rf"\b{re.escape(str(k))}\b", str(e)))]
        field = f"config[{min(found)[1]!r}]" if found else "config"
        raise ConfigError(f"reasoning_gym {field} for task {task!r} is invalid: {str(e) or type(e).__name__} "
                          f"(config: {dict(config)!r})") from e
    return built


def config_record(task: str, config: Mapping[str, Any] | None, seed: int, size: int) -> str:
    """The `task_config` field of the rows: the given config keys plus seed and size, as JSON; the
    reward rebuilds the config from it (the fields left out take their defaults again)."""
    fields = {**(config or {}), "seed": seed, "size": size}
    try:
        return plain_json.dumps(fields, "config")
    except TypeError as e:
        raise ConfigError(f"reasoning_gym {e}: give the task config as plain "
                          f"values (numbers, strings, lists, tuples, dicts)") from e


def rebuild_config(task: str, record: str) -> Any:
    """The config dataclass a row of `task` was generated with, from its `task_config` field."""
    from reasoning_gym.factory import DATASETS

    return DATASETS[task][1](**plain_json.loads(record))


def make_dataset(task: str, config: Any) -> Any:
    """The reasoning-gym dataset of `task` for a validated config dataclass (`task_config`)."""
    from reasoning_gym.factory import DATASETS

    return DATASETS[task][0](config=config)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"reasoning_gym {name} must be an integer >= {minimum}, got {value!r}")


def _row(task: str, config_json: str, entry: dict[str, Any], index: int, answer_format: str) -> dict[str, Any]:
    """One prompt row of a reasoning-gym entry (see the module docstring)."""
    question, answer = entry["question"], entry["answer"]
    return {
        "messages": [{"role": "user", "content": f"{question}\n\n{ANSWER_INSTRUCTIONS[answer_format]}"}],
        "question": question,
        "answer": None if answer is None else str(answer),
        "task": task,
        "task_config": config_json,
        "metadata": _metadata_json(task, entry, index),
        "answer_format": answer_format,
    }


def _metadata_json(task: str, entry: dict[str, Any], index: int) -> str:
    try:
        return plain_json.dumps(entry.get("metadata", {}), "metadata")
    except TypeError as e:
        raise ConfigError(f"reasoning_gym task {task!r}, entry {index}: {e}, so its rows cannot carry it "
                          f"to the reward; this task (or this config of it) is not supported") from e


def reasoning_gym_rows(task: str, config: Mapping[str, Any] | None = None, *, seed: int = 0,
                       train_size: int = 1000, eval_size: int = 100,
                       answer_format: str = DEFAULT_ANSWER_FORMAT) -> tuple[Any, Any]:
    """Training and held-out rows (two `datasets.Dataset`s, the second empty when `eval_size` is 0)
    of reasoning-gym `task` with `config`, asking for answers in `answer_format` ("tags" or
    "last_line"; see the module docstring)."""
    import datasets

    _check_int("seed", seed, 0)
    _check_int("train_size", train_size, 1)
    _check_int("eval_size", eval_size, 0)
    check_answer_format(answer_format)
    built = task_config(task, config, seed, train_size + eval_size)
    config_json = config_record(task, config, seed, train_size + eval_size)
    dataset = make_dataset(task, built)
    rows = [_row(task, config_json, dataset[i], i, answer_format) for i in range(train_size + eval_size)]
    train, held_out = rows[:train_size], rows[train_size:]
    seen = {row["question"] for row in train}
    kept = [row for row in held_out if row["question"] not in seen]
    if eval_size and not kept:
        raise ConfigError(f"reasoning_gym task {task!r}: every one of the {eval_size} held-out questions is also a "
                          f"training question; widen the config (more terms, digits, ...) or set eval_size=0")
    if len(kept) < len(held_out):
        warnings.warn(f"reasoning_gym task {task!r}: dropped {len(held_out) - len(kept)} of {len(held_out)} "
                      f"held-out rows whose question is also a training question", stacklevel=2)
    return datasets.Dataset.from_list(train), datasets.Dataset.from_list(kept)


def reasoning_gym_data(task: str, config: Mapping[str, Any] | None = None, *, seed: int = 0,
                       train_size: int = 1000, eval_size: int = 100, answer_format: str = DEFAULT_ANSWER_FORMAT,
                       **data_fields: Any) -> Any:
    """A `titanrl.DataConfig` of `reasoning_gym_rows(...)`: the rows in `train_rows`/`eval_rows`
    (no eval when `eval_size` is 0) and `messages_field="messages"`; `data_fields` are further
    DataConfig fields (`system_prompt`, `shuffle_seed`, `on_overlong`)."""
    from titanrl.config import DataConfig

    train, held_out = reasoning_gym_rows(task, config, seed=seed, train_size=train_size, eval_size=eval_size,
                                         answer_format=answer_format)
    return DataConfig(train_rows=train, eval_rows=held_out if len(held_out) else None, messages_field="messages",
                      **data_fields)
