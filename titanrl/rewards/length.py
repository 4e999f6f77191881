"""Length penalties: DAPO's soft overlong penalty, as a reward and as the rollout side's shaping term.

DAPO (Yu et al., 2025, eq. 13) penalises a response of length L that runs into the last `buffer`
units before the limit `max_length` linearly, from 0 at `max_length - buffer` to -1 at `max_length`:

    penalty(L) = 0                                  if L <= max_length - buffer
               = (max_length - buffer - L) / buffer if max_length - buffer < L <= max_length
               = -1                                 if L > max_length

`linear_overlong_penalty` is that shape; `rollout.shaping.overlong_buffer` adds
`rollout.shaping.overlong_penalty * penalty(completion tokens)` to every training sample's reward (with
max_length = rollout.sampling.max_new_tokens), and `LengthPenalty` is the same as a reward function on a
length of your choosing (characters by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def linear_overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong penalty in [-1, 0] (see the module docstring); `buffer` >= 1."""
    if buffer < 1 or max_length < buffer:
        raise ValueError(f"need 1 <= buffer <= max_length, got buffer {buffer} and max_length {max_length}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length > max_length:
        return -1.0
    return (start - length) / buffer


class LengthPenalty:
    """`reward(prompt, completion, **fields)`: `scale * linear_overlong_penalty(length(completion), ...)`.

    `length` counts the completion (default: characters; pass e.g.
    `lambda text: len(tokenizer.encode(text))` for tokens). The value is 0 for short completions
    and falls linearly to `-scale` at `max_length`.
    """

    def __init__(self, max_length: int, buffer: int, *, scale: float = 1.0,
                 length: Callable[[str], int] = len, name: str = "length_penalty") -> None:
        linear_overlong_penalty(0, max_length, buffer)  # checks the bounds now, not at the first sample
        self.max_length, self.buffer, self.scale, self.length = max_length, buffer, float(scale), length
        self.__name__ = self.__qualname__ = name  # the metric name, `reward/<name>/mean`

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        return self.scale * linear_overlong_penalty(self.length(completion), self.max_length, self.buffer)
