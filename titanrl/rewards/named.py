"""The names and weights of a run's rewards: what `reward/<name>/...` metrics and `reward_weights` refer to.

A reward's name is its function's `__name__` (the wrapped function's for a functools.partial,
the class name for a callable object, `lambda` for a lambda); a name taken by an earlier reward
gets `_2`, `_3`, ... in list order, so every name is unique. Built-in rewards carry a chosen
name (`exact_match`, `format`, `length_penalty`, or the `name=` they were given).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from titanrl.rewards.batched import is_batched


@dataclass(frozen=True)
class NamedReward:
    """One reward function as the scorer runs it."""

    fn: Callable[..., Any]
    """The reward callable."""
    name: str
    """Its unique metric name (`reward/<name>/mean`)."""
    weight: float
    """What its value is multiplied by in the sample's total reward (RunConfig.reward_weights)."""
    batched: bool
    """Called once per batch with lists (`titanrl.batched_reward`) instead of once per sample."""


def _base_name(fn: Any) -> str:
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__name__", None)
    if not isinstance(name, str) or not name:
        name = type(target).__name__
    return re.sub(r"[^A-Za-z0-9_.-]", "", name) or "reward"


def reward_names(fns: Sequence[Any]) -> list[str]:
    """The unique metric name of each reward, in order (see the module docstring)."""
    names: list[str] = []
    for fn in fns:
        base, k = _base_name(fn), 1
        name = base
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def named_rewards(fns: Sequence[Callable[..., Any]], weights: Sequence[float] | None = None) -> list[NamedReward]:
    """`fns` with their names and weights (all 1.0 when `weights` is None or empty)."""
    if weights and len(weights) != len(fns):
        raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(fns)} rewards: "
                         "give one weight per reward, in the order of `rewards`")
    weights = list(weights) if weights else [1.0] * len(fns)
    return [NamedReward(fn, name, float(w), is_batched(fn)) for fn, name, w in zip(fns, reward_names(fns), weights)]
