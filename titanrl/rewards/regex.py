r"""Regex rewards: a format check (does the completion look right?) or an extract-and-compare answer check.

    RegexReward(r"<think>.*</think>\s*<answer>.*</answer>", match="fullmatch", name="format")
    RegexReward(r"answer:\s*(-?\d+)", field="answer", name="answer")   # group 1 == row["answer"]
"""

from __future__ import annotations

import re
from typing import Any, Literal


class RegexReward:
    """`reward(prompt, completion, **fields)`: `value` when the completion matches `pattern`, else 0.0.

    `match`: 'search' (anywhere), 'match' (at the start) or 'fullmatch' (the whole completion,
    after stripping surrounding whitespace when `strip`). With `field`, a match counts only when its
    first group (the whole match when the pattern has no group) equals `str(fields[field])`,
    both stripped: the pattern extracts the answer and the row holds the reference.
    """

    def __init__(self, pattern: str, *, match: Literal["search", "match", "fullmatch"] = "search",
                 flags: int = re.DOTALL, field: str | None = None, value: float = 1.0, strip: bool = True,
                 name: str = "format") -> None:
        if match not in ("search", "match", "fullmatch"):
            raise ValueError(f"match must be 'search', 'match' or 'fullmatch', got {match!r}")
        self.regex = re.compile(pattern, flags)
        self.match, self.field, self.value, self.strip = match, field, float(value), strip
        self.__name__ = self.__qualname__ = name  # the metric name, `reward/<name>/mean`

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        text = completion.strip() if self.strip else completion
        found = getattr(self.regex, self.match)(text)
        if found is None:
            return 0.0
        if self.field is None:
            return self.value
        if self.field not in fields:
            raise KeyError(f"the row has no {self.field!r} field (fields: {sorted(fields)})")
        extracted = found.group(1) if self.regex.groups else found.group(0)
        return self.value if extracted is not None and extracted.strip() == str(fields[self.field]).strip() else 0.0
