"""`@titanrl.batched_reward`: a reward called once per scored batch with lists, instead of once per sample.

A batched reward is `fn(prompts, completions, **fields) -> list[float]`: `prompts` and
`completions` are lists of the batch's samples, and every dataset field is a list aligned with
them (None where a row lacks that field). It returns one reward per sample, in order. Use it
when grading is cheaper in bulk (one model call, one subprocess, one HTTP request for many
answers). It may be sync or `async def`; `scoring.timeout_s` limits the whole call.

What a batch is: the samples one scorer call scores together, i.e. a lock-step worker's whole
request (every group of its prompts), a continuous worker's one group, an episode alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

BATCHED_ATTRIBUTE = "__titanrl_batched_reward__"
"""Set to True on a function by `batched_reward`."""


def batched_reward(fn: F) -> F:
    """Marks `fn` as a batched reward (see the module docstring); returns `fn` itself."""
    try:
        setattr(fn, BATCHED_ATTRIBUTE, True)
    except AttributeError as e:  # a bound method or a builtin cannot take attributes
        raise TypeError(f"@batched_reward needs a function or a callable object, got {type(fn).__name__}; "
                        "wrap it in a def") from e
    return fn


def is_batched(fn: Any) -> bool:
    """Whether `fn` (or the function a functools.partial wraps) was marked with `batched_reward`."""
    return bool(getattr(fn, BATCHED_ATTRIBUTE, False) or getattr(getattr(fn, "func", None), BATCHED_ATTRIBUTE, False))
