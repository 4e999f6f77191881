"""Exact match: 1.0 when the completion is the row's reference answer, else 0.0.

    rewards=[titanrl.rewards.exact_match]                       # rows carry "answer"
    rewards=[ExactMatch("label", ignore_case=True)]             # another field, case-insensitive
"""

from __future__ import annotations

from typing import Any


class ExactMatch:
    """`reward(prompt, completion, **fields)`: 1.0 when `completion` equals `fields[field]`, else 0.0.

    Both sides are compared as text (`str(reference)`), stripped of surrounding whitespace when
    `strip`, lower-cased when `ignore_case`. A row without `field` is an error of that sample
    (the scorer reports it), not a silent 0.
    """

    def __init__(self, field: str = "answer", *, strip: bool = True, ignore_case: bool = False,
                 name: str = "exact_match") -> None:
        self.field, self.strip, self.ignore_case = field, strip, ignore_case
        self.__name__ = self.__qualname__ = name  # the metric name, `reward/<name>/mean`

    def _norm(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text.lower() if self.ignore_case else text

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        if self.field not in fields:
            raise KeyError(f"the row has no {self.field!r} field (fields: {sorted(fields)})")
        return 1.0 if self._norm(completion) == self._norm(str(fields[self.field])) else 0.0


exact_match = ExactMatch()
"""Exact match against the row's `answer` field, whitespace stripped."""
