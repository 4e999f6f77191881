"""Applying user reward functions to completions, shared by single-turn and episode rollouts."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any


class RewardError(RuntimeError):
    """A reward function raised or returned a non-number; names the function and the prompt."""


def row_fields(row: dict[str, Any], prompt_field: str) -> dict[str, Any]:
    """A dataset row minus its prompt: what rewards receive as keyword arguments."""
    return {k: v for k, v in row.items() if k != prompt_field}


def score(rewards: list[Callable[..., Any]], prompt: str, completion: str, fields: dict[str, Any]) -> float:
    """Sum of all reward functions on one completion; awaits async rewards."""
    total = 0.0
    for fn in rewards:
        try:
            value = fn(prompt, completion, **fields)
            if inspect.isawaitable(value):
                value = asyncio.run(_await(value))
        except Exception as e:
            name = getattr(fn, "__qualname__", repr(fn))
            raise RewardError(f"reward {name} raised {type(e).__name__}: {e} (prompt {prompt[:80]!r})") from e
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RewardError(f"reward {getattr(fn, '__qualname__', fn)} returned {value!r}; it must return a float")
        total += float(value)
    return total


async def _await(value: Any) -> Any:
    # asyncio.run takes a coroutine; a reward may return any awaitable.
    return await value


def eval_summary(rewards: list[float], correct_threshold: float, policy_version: int) -> dict[str, Any]:
    """What a worker's `evaluate` returns to the driver."""
    return {
        "rewards": rewards,
        "correct": sum(r >= correct_threshold for r in rewards),
        "policy_version": policy_version,
    }
