"""reasoning-gym rewards: the task's own checker on the completion's final answer, and a format term.

    from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format
    rewards=[reasoning_gym_answer, reasoning_gym_format], reward_weights=[1.0, 0.1]

For rows of `titanrl.data_sources.reasoning_gym` (they carry `task`, `task_config`, `metadata`,
`answer` and `question`). The answer convention is reasoning-gym's own, asked for by the prompt
(`ANSWER_INSTRUCTION`): the final answer is the text of the completion's last
`<answer>...</answer>` block (`final_answer`, as `reasoning_gym.utils.extract_answer` reads it).

- `reasoning_gym_answer`: 1.0 when the task's own checker, `score_answer(final_answer, entry)`
  of the task's dataset rebuilt with the row's task config (some checkers read it), gives full
  marks; else 0.0, and 0.0 when there is no answer block.
- `reasoning_gym_score`: the checker's score as it is, partial credit included. Checkers give
  credit that is not correctness: gsm_symbolic 0.01 for any wrong number, chain_sum and others
  `len(reference) / len(answer)` when the reference is a substring of the answer (so
  `<answer>-14282 or 5</answer>` earns 0.55 for -14282), hence the all-or-nothing default.
- `reasoning_gym_format`: 1.0 when the completion ends with exactly one non-empty answer block
  (only whitespace after `</answer>`), else 0.0. A separate reward, so `reward/<name>/mean`
  shows format and correctness apart; weight it low (eval counts a completion correct when its
  summed reward reaches `eval.correct_threshold`, 1.0 by default, which a format weight below 1
  cannot reach alone).

A checker that raises (some do on malformed answers) fails that sample like any reward error
(`reward/<name>/errors`). reasoning-gym is imported on the first call, not with this module.
"""

from __future__ import annotations

import functools
from typing import Any

from titanrl.data_sources import plain_json
from titanrl.data_sources.reasoning_gym import (ANSWER_INSTRUCTION, ANSWER_TAG, final_answer, make_dataset,
                                                 rebuild_config)

__all__ = ["ANSWER_INSTRUCTION", "ReasoningGymAnswer", "final_answer", "reasoning_gym_answer", "reasoning_gym_format",
           "reasoning_gym_score"]

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

    0.0 without an answer block. With `partial_credit=False`, 1.0 when the checker gives full
    marks, else 0.0; with `partial_credit=True`, the checker's own score in [0, 1]. A row without
    `task`, `task_config` or `metadata` is a dataset error (it raises), not a wrong answer.
    """

    def __init__(self, *, partial_credit: bool = False, name: str = "reasoning_gym_answer") -> None:
        self.partial_credit = partial_credit
        self.__name__ = self.__qualname__ = name  # the metric name, `reward/<name>/mean`

    def __call__(self, prompt: str, completion: str, task: str | None = None, task_config: str | None = None,
                 metadata: str | None = None, answer: str | None = None, question: str = "", **fields: Any) -> float:
        if task is None or task_config is None or metadata is None:
            raise ValueError(f"{self.__name__} needs the row fields 'task', 'task_config' and 'metadata' "
                             "(rows of titanrl.data_sources.reasoning_gym)")
        guess = final_answer(completion)
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


def reasoning_gym_format(prompt: str, completion: str, **fields: Any) -> float:
    """1.0 when the completion has exactly one `<answer>` and one `</answer>`, they make a non-empty
    block, and nothing but whitespace follows it; else 0.0."""
    if completion.count("<answer>") != 1 or completion.count("</answer>") != 1:
        return 0.0
    block = ANSWER_TAG.search(completion)
    if block is None or not block.group(1).strip() or completion[block.end():].strip():
        return 0.0
    return 1.0
