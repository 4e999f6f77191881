"""The reward scorer of a run's rollout worker, from the run's config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titanrl.config.schema import RunConfig
from titanrl.rewards.batch_scoring import RewardScorer


def run_scorer(rewards: list[Callable[..., Any]], config: RunConfig) -> RewardScorer:
    """A scorer of `rewards` (resolved callables) under `config.scoring`'s concurrency, timeout and
    error value, weighted by `config.reward_weights`."""
    sc = config.scoring
    return RewardScorer(rewards, timeout_s=sc.timeout_s, error_value=sc.error_value, concurrency=sc.concurrency,
                        weights=list(config.reward_weights) or None)
