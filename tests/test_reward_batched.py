"""Batched, async and weighted rewards through the one scorer (`RewardScorer`), and their per-reward terms."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import titanrl
from titanrl.rewards.batch_scoring import RewardScorer, ToScore


def _items(*completions: str, **fields) -> list[ToScore]:
    return [ToScore(f"p{i}", c, {k: v[i] for k, v in fields.items()}) for i, c in enumerate(completions)]


def _score(rewards, items, weights=None, timeout_s=5.0):
    scorer = RewardScorer(rewards, timeout_s=timeout_s, error_value=-1.0, concurrency=4, weights=weights)
    try:
        return scorer.score_results(items)
    finally:
        scorer.close()


def test_weighted_sum_with_sync_async_and_batched_rewards():
    """Total = 2 * correct + 0.5 * format + 1 * length, by hand for three samples; the terms hold
    each reward's unweighted value; the batched rewards (sync and async) are called once with
    aligned lists of prompts, completions and fields."""
    calls = []

    def correct(prompt, completion, answer, **fields):
        return 1.0 if completion == answer else 0.0

    @titanrl.batched_reward
    def format_ok(prompts, completions, answer, **fields):
        calls.append(("format", prompts, completions, answer))
        return [1.0 if c.isdigit() else 0.0 for c in completions]

    @titanrl.batched_reward
    async def length(prompts, completions, **fields):
        calls.append(("length", prompts, completions, fields["answer"]))
        await asyncio.sleep(0)
        return np.array([-0.1 * len(c) for c in completions])  # any sequence of real numbers

    items = _items("3", "4", "x", answer=["3", "5", "7"])
    results = _score([correct, format_ok, length], items, weights=[2.0, 0.5, 1.0])
    assert [r.error for r in results] == [None, None, None]
    assert [r.reward for r in results] == pytest.approx([2.5 - 0.1, 0.5 - 0.1, -0.1])
    assert results[0].terms.values == pytest.approx({"correct": 1.0, "format_ok": 1.0, "length": -0.1})
    assert results[2].terms.values == pytest.approx({"correct": 0.0, "format_ok": 0.0, "length": -0.1})
    assert calls == [("format", ["p0", "p1", "p2"], ["3", "4", "x"], ["3", "5", "7"]),
                     ("length", ["p0", "p1", "p2"], ["3", "4", "x"], ["3", "5", "7"])]
    assert all(set(r.terms.seconds) == {"correct", "format_ok", "length"} for r in results)
    assert all(t >= 0 for r in results for t in r.terms.seconds.values())


def test_batched_failures_cost_their_samples_only_and_later_rewards_skip_them():
    """A bad element fails its sample (error_value, `failed` names the reward) and the rewards after
    are not called on it; a batched reward returning the wrong count fails every sample it got."""
    seen = []

    @titanrl.batched_reward
    def picky(prompts, completions, **fields):
        return [1.0 if c != "bad" else float("nan") for c in completions]

    @titanrl.batched_reward
    def later(prompts, completions, **fields):
        seen.append(list(completions))
        return [0.25] * len(completions)

    results = _score([picky, later], _items("ok", "bad", "fine"))
    assert [r.reward for r in results] == [1.25, -1.0, 1.25]
    assert results[1].terms.failed == "picky" and "picky returned nan" in results[1].error
    assert seen == [["ok", "fine"]]

    @titanrl.batched_reward
    def short(prompts, completions, **fields):
        return [1.0]

    results = _score([short], _items("a", "b"))
    assert [r.reward for r in results] == [-1.0, -1.0]
    assert all("returned 1 rewards for 2 samples" in r.error and r.terms.failed == "short" for r in results)


def test_weights_must_match_the_rewards():
    with pytest.raises(ValueError, match="reward_weights has 1 entries but there are 2 rewards"):
        RewardScorer([lambda p, c, **f: 0.0] * 2, timeout_s=None, error_value=0.0, weights=[1.0])


def test_a_sample_gets_the_same_reward_alone_or_in_a_batch():
    """What a sample gets from a batched reward does not depend on the batch it is in (for a reward
    that grades each element on its own), as for per-sample rewards."""
    @titanrl.batched_reward
    def digits(prompts, completions, **fields):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    items = _items("12a", "b", "999", "")
    together = [(r.reward, r.error) for r in _score([digits], items, weights=[3.0])]
    alone = [(r.reward, r.error) for item in items for r in _score([digits], [item], weights=[3.0])]
    assert together == alone == [(2.0, None), (0.0, None), (3.0, None), (0.0, None)]
