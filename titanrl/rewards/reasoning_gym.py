"""reasoning-gym rewards: the task's own checker on the completion's final answer, and a format term.

    from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format
    rewards=[reasoning_gym_answer, reasoning_gym_format], reward_weights=[1.0, 0.1]

For rows of `titanrl.data_sources.reasoning_gym` (they carry `task`, `task_config`, `metadata`,
`answer`, `question` and `answer_format`). The final answer is read with the convention the
row's prompt asked for, its `answer_format` (`final_answer(completion, answer_format)`; a row
without the field is "tags"):

- "tags" (reasoning-gym's own, `ANSWER_INSTRUCTION`): the text of the completion's last
  `<answer>...</answer>` block, as `reasoning_gym.utils.extract_answer` reads it;
- "last_line" (`LAST_LINE_INSTRUCTION`): the answer of the completion's last `Answer: ...` line
  (case-insensitive, markdown asterisks, surrounding whitespace and one trailing period
  tolerated; `titanrl.data_sources.reasoning_gym` lists exactly what is accepted).

- `reasoning_gym_answer`: 1.0 when the task's own checker, `score_answer(final_answer, entry)`
  of the task's dataset rebuilt with the row's task config (some checkers read it), gives full
  marks; else 0.0, and 0.0 when there is no answer (no block, no answer line).
- `reasoning_gym_score`: the checker's score as it is, partial credit included. Checkers give
  credit that is not correctness: gsm_symbolic 0.01 for any wrong number, chain_sum and others
  `len(reference) / len(answer)` when the reference is a substring of the answer (so
  `<answer>-14282 or 5</answer>` earns 0.55 for -14282), hence the all-or-nothing default.
- `reasoning_gym_format`: under "tags", 1.0 when the completion ends with exactly one non-empty
  answer block (only whitespace after `</answer>`); under "last_line", 1.0 when exactly one line
  is an answer line, its answer is non-empty and only whitespace follows that line; else 0.0.
  A separate reward, so `reward/<name>/mean` shows format and correctness apart; weight it low
  (eval counts a completion correct when its weighted summed reward reaches
  `eval.correct_threshold`, 1.0 by default, which a format weight below 1 cannot reach alone:
  with `reward_weights=[1.0, 0.1]` a completion is correct exactly when the answer reward is 1).

A row whose `answer_format` is not a known convention is a dataset error (the reward raises).

A checker that raises (some do on malformed answers) fails that sample like any reward error
(`reward/<name>/errors`). reasoning-gym is imported on the first call, not with this module.
"""

from __future__ import annotations

import functools
from typing import Any

from titanrl.data_sources import plain_json
from titanrl.data_sources.reasoning_gym import (ANSWER_FORMATS, ANSWER_INSTRUCTION, ANSWER_TAG,
                                                 DEFAULT_ANSWER_FORMAT, LAST_LINE_INSTRUCTION, answer_lines,
                                                 final_answer, make_dataset, rebuild_config)

__all__ = ["ANSWER_FORMATS", "ANSWER_INSTRUCTION", "LAST_LINE_INSTRUCTION", "ReasoningGymAnswer", "final_answer",
           "reasoning_gym_answer", "reasoning_gym_format", "reasoning_gym_score"]

FULL_MARKS = 1.0 - 1e-9
"""A checker score at least this is a correct answer (checkers compute some scores in floating point)."""


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config_json: str) -> Any:
    """The `score_answer` of `task`'s dataset under the config a row was generated with (built once
    per process and config)."""
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"the row's task {task!r} is not a reasoning-gym task")
    return make_dataset(task, rebuild_config(task, config_json)).score_answer


class ReasoningGymAnswer:
    """`reward(prompt, completion, **row_fields)`: the task's checker on the completion's final answer.

    The answer is read in the row's `answer_format` ("tags" when the row has none); 0.0 without
    one. With `partial_credit=False`, 1.0 when the checker gives full marks, else 0.0; with
    `partial_credit=True`, the checker's own score in [0, 1]. A row without `task`, `task_config`
    or `metadata`, or with an unknown `answer_format`, is a dataset error (it raises), not a
    wrong answer.
    """

    def __init__(self, *, partial_credit: bool = False, name: str = "reasoning_gym_answer") -> None:
        self.partial_credit = partial_credit
        self.__name__ = self.__qualname__ = name  # the metric name, `reward/<name>/mean`

    def __call__(self, prompt: str, completion: str, task: str | None = None, task_config: str | None = None,
                 metadata: str | None = None, answer: str | None = None, question: str = "",
                 answer_format: str | None = None, **fields: Any) -> float:
        if task is None or task_config is None or metadata is None:
            raise ValueError(f"{self.__name__} needs the row fields 'task', 'task_config' and 'metadata' "
                             "(rows of titanrl.data_sources.reasoning_gym)")
        guess = final_answer(completion, answer_format or DEFAULT_ANSWER_FORMAT)
        if guess is None:
            return 0.0
        entry = {"question": question, "answer": answer, "metadata": plain_json.loads(metadata)}
        score = float(_scorer(task, task_config)(guess, entry))
        if self.partial_credit:
            return score
        return 1.0 if score >= FULL_MARKS else 0.0


reasoning_gym_answer = ReasoningGymAnswer()
"""1.0 when the task's checker gives the final answer full marks, else 0.0."""
reasoning_gym_score = ReasoningGymAnswer(partial_credit=True, name="reasoning_gym_score")
"""The task checker's own score of the final answer, partial credit included (see the module docstring)."""


def reasoning_gym_format(prompt: str, completion: str, answer_format: str | None = None, **fields: Any) -> float:
    """In the row's `answer_format` ("tags" when it has none): "tags": 1.0 when the completion has
    exactly one `<answer>` and one `</answer>`, they make a non-empty block, and nothing but
    whitespace follows it; "last_line": 1.0 when exactly one line is an answer line, its answer is
    non-empty and nothing but whitespace follows that line; else 0.0."""
    answer_format = answer_format or DEFAULT_ANSWER_FORMAT
    if answer_format == "last_line":
        found = answer_lines(completion)
        if len(found) != 1 or not found[0][1]:
            return 0.0
        after = completion.splitlines()[found[0][0] + 1:]
        return 0.0 if any(line.strip() for line in after) else 1.0
    if answer_format != "tags":
        raise ValueError(f"answer_format {answer_format!r} is not one of {', '.join(map(repr, ANSWER_FORMATS))}")
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return 0.0
    block = ANSWER_TAG.search(completion)
    if block is None or not block.group(1).strip() or completion[block.end():].strip():
        return 0.0
    return 1.0
