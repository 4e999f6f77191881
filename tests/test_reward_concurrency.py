"""Rewards never serialize a batch: `RewardScorer` scores a request's samples concurrently with
exactly the per-sample results it gives each sample scored alone, and a hung reward cannot
starve later batches.

The scorer is driven directly with small reward functions (no vLLM): they are its input.
Concurrency is shown by counts of calls in progress and by what finished before what, never
by a wall-clock bound (the machine is shared and busy); timeouts only guard against hangs.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from titanrl.config import (
    ConfigError,
    DataConfig,
    EngineConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    ScoringConfig,
    apply_overrides,
    validate,
)
from titanrl.rewards.batch_scoring import FAST_STREAK, HELPER_NAME, RewardScorer, ToScore


class Peak:
    """Counts calls in progress and remembers the most at once (thread-safe)."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.lock = threading.Lock()

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.now -= 1


def _items(n: int, **fields: Any) -> list[ToScore]:
    return [ToScore(str(i), f"completion {i}", dict(fields)) for i in range(n)]


def _helper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == HELPER_NAME]


def test_sync_rewards_of_a_batch_run_concurrently_in_a_bounded_pool():
    """64 samples of a sync reward sleeping 50 ms (3.2 s one after another) run 16 at a time with
    reward_concurrency 16 (the limit is reached, never exceeded), each sample's own reward
    in input order; a second batch reuses the same helper threads instead of starting new ones."""
    peak = Peak()

    def grader(prompt, completion, **fields):
        with peak:
            time.sleep(0.05)
        return int(prompt) + 0.5

    scorer = RewardScorer([grader], timeout_s=10.0, error_value=-1.0, concurrency=16)
    try:
        results = scorer.score(_items(64))
        assert results == [(i + 0.5, None) for i in range(64)]
        # Concurrency shown by behaviour, not a wall-clock bound: the 16-thread limit is reached
        # (64 calls of 50 ms overlap) and never exceeded.
        assert peak.most == 16
        # The scorer reports the time it spent: at least one 50 ms sleep (a lower bound only; an
        # upper one would depend on the machine's load).
        assert scorer.seconds >= 0.05
        helpers = set(_helper_threads())
        assert scorer.score(_items(16)) == [(i + 0.5, None) for i in range(16)]
        assert set(_helper_threads()) == helpers and len(helpers) <= 16
    finally:
        scorer.close()


def test_async_rewards_of_a_batch_are_awaited_together():
    """64 samples of an async reward awaiting 50 ms are all in flight at once (not bounded by
    reward_concurrency, which is for sync calls), in input order; a sample mixing a sync and an
    async reward sums both."""
    peak = Peak()

    async def grader(prompt, completion, **fields):
        with peak:
            await asyncio.sleep(0.05)
        return float(prompt)

    scorer = RewardScorer([grader], timeout_s=10.0, error_value=-1.0, concurrency=2)
    try:
        results = scorer.score(_items(64))
        assert results == [(float(i), None) for i in range(64)]
        assert peak.most == 64
    finally:
        scorer.close()
    mixed = RewardScorer([grader, lambda p, c, bonus, **f: bonus], timeout_s=10.0, error_value=-1.0)
    try:
        assert mixed.score(_items(3, bonus=0.25)) == [(0.25, None), (1.25, None), (2.25, None)]
    finally:
        mixed.close()


release = threading.Event()
"""Set at the end of a test to let rewards that were left hanging return."""


def mode_reward(prompt: str, completion: str, mode: str, **fields: Any) -> Any:
    """Behaves as the row's `mode` says, so one batch holds every kind of failure at once."""
    if mode == "raise":
        raise ValueError("no answer found")
    if mode == "own_timeout":
        raise TimeoutError("grader's own")
    if mode == "hang":
        release.wait(10)
    if mode == "awaitable":  # a sync callable handing back an awaitable
        return asyncio.sleep(0, result=0.75)
    if mode == "slow_awaitable":
        return asyncio.sleep(10, result=0.75)
    return {"nan": math.nan, "inf": -math.inf, "none": None, "bool": True, "str": "1.0", "list": [1.0],
            "np": np.float32(0.5), "tensor": torch.tensor(0.25), "vector": torch.tensor([1.0]),
            "huge": 10**400, "big": 1e308}.get(mode, 1.0)


async def async_mode_reward(prompt: str, completion: str, mode: str, **fields: Any) -> Any:
    """`mode_reward` as a coroutine; 'async_hang' awaits past any timeout, 'async_raise' raises."""
    if mode == "async_hang":
        await asyncio.sleep(10)
    if mode == "async_raise":
        raise KeyError("answer")
    return mode_reward(prompt, completion, mode if mode not in ("hang", "awaitable", "slow_awaitable") else "ok")


MODES = ["ok", "raise", "own_timeout", "hang", "awaitable", "slow_awaitable", "nan", "inf", "none", "bool", "str",
         "list", "np", "tensor", "vector", "huge", "big", "async_hang", "async_raise"]


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("timeout_s", [0.3, None])
def test_failures_are_contained_per_sample_exactly_as_when_scored_alone(concurrency, timeout_s):
    """Raising, timing out (sync, async, and an awaitable returned by a sync reward), non-finite,
    non-numeric and overflowing rewards give each sample of a concurrent batch exactly the
    (reward, error) it gets scored alone, one call at a time, text included, in input order; rewards after a failing one are not called,
    and the healthy samples of the same batch are unaffected. With timeout_s=None nothing can hang,
    so the hanging modes are left out there."""
    later_calls: list[str] = []

    def later(prompt, completion, **fields):
        later_calls.append(prompt)
        return 0.125

    rewards = [mode_reward, functools.partial(async_mode_reward), later]
    modes = MODES if timeout_s is not None else [m for m in MODES if "hang" not in m and m != "slow_awaitable"]
    # 'big' twice on one sample overflows the sum; each mode in two samples so groups are mixed.
    items = [ToScore(f"{mode} #{k}", "3", {"mode": mode}) for k in range(2) for mode in modes]
    try:
        alone = RewardScorer(rewards, timeout_s=timeout_s, error_value=-1.0, concurrency=1)
        try:
            expected = [alone.score([item])[0] for item in items]
        finally:
            alone.close()
        serial_later = sorted(later_calls)
        later_calls.clear()
        scorer = RewardScorer(rewards, timeout_s=timeout_s, error_value=-1.0, concurrency=concurrency)
        try:
            assert scorer.score(items) == expected
        finally:
            scorer.close()
        assert sorted(later_calls) == serial_later
        by_mode = {i.fields["mode"]: e for i, e in zip(items, expected, strict=True) if i.prompt.endswith("#0")}
        assert by_mode["ok"] == (2.125, None) and by_mode["tensor"] == (0.625, None)
        assert by_mode["raise"][1] == "reward mode_reward raised ValueError: no answer found (prompt 'raise #0')"
        assert by_mode["big"][1] == "rewards summed to inf (prompt 'big #0')"
        if timeout_s is not None:
            assert by_mode["hang"] == (-1.0, "reward mode_reward timed out after 0.3 s (prompt 'hang #0')")
            assert by_mode["async_hang"][1] == "reward async_mode_reward timed out after 0.3 s (prompt 'async_hang #0')"
            assert by_mode["slow_awaitable"][1].endswith("timed out after 0.3 s (prompt 'slow_awaitable #0')")
    finally:
        release.set()  # let the abandoned 'hang' calls return
        time.sleep(0.05)
        release.clear()


@pytest.mark.parametrize("timeout_s", [0.3, None])
def test_a_fast_sync_reward_scores_a_batch_on_one_helper_with_each_calls_own_result(timeout_s):
    """Once a sync reward has been fast (FAST_STREAK calls under FAST_CALL_S), a batch's calls run
    back to back on one helper thread instead of one helper each (one hand-off for the lot), and
    every sample still gets exactly what it gets scored alone: errors, non-numbers, a returned
    awaitable, and a hung call that times out by itself (the samples after it are scored)."""
    threads: list[int] = []

    def graded(prompt, completion, mode, **fields):
        threads.append(threading.get_ident())
        return mode_reward(prompt, completion, mode, **fields)

    modes = MODES if timeout_s is not None else [m for m in MODES if "hang" not in m and m != "slow_awaitable"]
    items = [ToScore(f"{mode} #{k}", "3", {"mode": mode}) for k in range(2) for mode in modes]
    try:
        alone = RewardScorer([graded], timeout_s=timeout_s, error_value=-1.0, concurrency=1)
        try:
            expected = [alone.score([item])[0] for item in items]
        finally:
            alone.close()
        scorer = RewardScorer([graded], timeout_s=timeout_s, error_value=-1.0, concurrency=4)
        try:
            scorer.score(_items(FAST_STREAK, mode="ok"))  # one helper per call while its speed is unknown
            threads.clear()
            assert scorer.score(_items(8, mode="ok")) == [(1.0, None)] * 8
            assert len(threads) == 8 and len(set(threads)) == 1
            assert scorer.score(items) == expected
        finally:
            scorer.close()
        if timeout_s is not None:
            by_prompt = dict(zip((i.prompt for i in items), expected, strict=True))
            reward, error = by_prompt["hang #0"]
            assert reward == -1.0 and error.endswith("graded timed out after 0.3 s (prompt 'hang #0')")
    finally:
        release.set()  # let the abandoned 'hang' calls return
        time.sleep(0.05)
        release.clear()


def test_fast_stages_started_in_one_loop_turn_share_one_helper_and_keep_their_own_results():
    """The groups one engine step finishes are scored together: concurrent `score_async` calls of
    a fast reward, started in one turn of the event loop, run as one batch on one helper thread,
    and each call still gets what scoring its items alone gives, also when a call among an
    earlier caller's items hangs (it times out alone; the later callers' items are scored)."""
    threads: list[int] = []

    def graded(prompt, completion, mode, **fields):
        threads.append(threading.get_ident())
        return mode_reward(prompt, completion, mode, **fields)

    groups = [[ToScore(f"{mode} #{g}", "3", {"mode": mode}) for mode in ("ok", "raise", "nan", "awaitable")]
              for g in range(4)]
    groups[1].insert(2, ToScore("hang #1", "3", {"mode": "hang"}))

    async def together(calls):
        return await asyncio.gather(*(scorer.score_async(items) for items in calls))

    try:
        alone = RewardScorer([graded], timeout_s=0.3, error_value=-1.0, concurrency=1)
        try:
            expected = [[alone.score([item])[0] for item in items] for items in groups]
        finally:
            alone.close()
        scorer = RewardScorer([graded], timeout_s=0.3, error_value=-1.0, concurrency=4)
        try:
            scorer.score(_items(FAST_STREAK, mode="ok"))  # one helper per call while its speed is unknown
            threads.clear()
            assert asyncio.run(together([_items(3, mode="ok") for _ in range(4)])) == [[(1.0, None)] * 3] * 4
            assert len(threads) == 12 and len(set(threads)) == 1
            assert asyncio.run(together(groups)) == expected
        finally:
            scorer.close()
        assert expected[1][2][1].endswith("graded timed out after 0.3 s (prompt 'hang #1')")
    finally:
        release.set()  # let the abandoned 'hang' call return
        time.sleep(0.05)
        release.clear()


def test_a_slow_sync_reward_keeps_one_helper_per_sample():
    """A reward whose calls take milliseconds (a grader service, a sandbox) is never run back to
    back: its samples keep running on several helpers at once."""
    threads: list[int] = []

    def slow(prompt, completion, **fields):
        threads.append(threading.get_ident())
        time.sleep(0.005)
        return 1.0

    scorer = RewardScorer([slow], timeout_s=5.0, error_value=-1.0, concurrency=4)
    try:
        scorer.score(_items(FAST_STREAK))
        threads.clear()
        assert scorer.score(_items(8)) == [(1.0, None)] * 8
        assert len(set(threads)) > 1
    finally:
        scorer.close()


def test_timeout_counts_from_the_call_not_the_wait_for_a_helper():
    """With one helper, four 150 ms calls queue for 0.6 s in all; each runs under the 0.4 s
    timeout, so none times out (the deadline starts when a helper takes the call)."""

    def grader(prompt, completion, **fields):
        time.sleep(0.15)
        return 1.0

    scorer = RewardScorer([grader], timeout_s=0.4, error_value=-1.0, concurrency=1)
    try:
        assert scorer.score(_items(4)) == [(1.0, None)] * 4
    finally:
        scorer.close()


def test_hung_sync_rewards_do_not_block_later_batches():
    """With reward_concurrency 2, a batch whose two rewards hang far past the timeout fills every
    helper; both samples time out, and the next batches still score promptly on fresh helpers
    (the hung ones left the pool); once the hung calls return, their threads exit."""
    hung = threading.Event()

    def grader(prompt, completion, **fields):
        if prompt.startswith("hang"):
            hung.wait(10)
        return 1.0

    scorer = RewardScorer([grader], timeout_s=0.2, error_value=-1.0, concurrency=2)
    try:
        before = set(_helper_threads())
        first = scorer.score([ToScore("hang a", "", {}), ToScore("hang b", "", {})])
        name = "test_hung_sync_rewards_do_not_block_later_batches.<locals>.grader"
        assert first == [(-1.0, f"reward {name} timed out after 0.2 s (prompt 'hang a')"),
                         (-1.0, f"reward {name} timed out after 0.2 s (prompt 'hang b')")]
        abandoned = set(_helper_threads()) - before
        assert len(abandoned) == 2 and all(t.is_alive() for t in abandoned)
        for _ in range(3):
            assert scorer.score(_items(6)) == [(1.0, None)] * 6
        # They finished while the hung calls still hang: nothing waited for those helpers.
        assert not hung.is_set() and all(t.is_alive() for t in abandoned)
        hung.set()
        for t in abandoned:
            t.join(5)
        assert not any(t.is_alive() for t in abandoned)
    finally:
        hung.set()
        scorer.close()


def test_score_async_runs_on_the_callers_loop_and_score_refuses_one():
    """score_async scores on the caller's running loop (how EnvRunner overlaps scoring with
    generation), two calls at once share the helpers; score() inside a running loop is a caller
    error, not a reward failure; a closed scorer refuses sync work; concurrency < 1 is refused."""

    def grader(prompt, completion, **fields):
        time.sleep(0.05)
        return float(prompt)

    scorer = RewardScorer([grader], timeout_s=5.0, error_value=-1.0, concurrency=4)

    async def main():
        both = await asyncio.gather(scorer.score_async(_items(8)), scorer.score_async(_items(3)))
        with pytest.raises(RuntimeError, match="running event loop"):
            scorer.score(_items(1))
        return both

    try:
        first, second = asyncio.run(main())
        assert first == [(float(i), None) for i in range(8)] and second == [(0.0, None), (1.0, None), (2.0, None)]
    finally:
        scorer.close()
    with pytest.raises(RuntimeError, match="scorer is closed"):
        scorer.score(_items(1))
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        RewardScorer([grader], timeout_s=None, error_value=0.0, concurrency=0)


def test_reward_concurrency_config_is_validated(tmp_path):
    """scoring.concurrency defaults to 16, accepts 1, and 0, negatives or a non-int are
    refused by validate / apply_overrides with a message naming the field."""
    from titanrl.models.tiny import write_tiny_checkpoint

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    config = RunConfig(model=ModelConfig(checkpoint=str(write_tiny_checkpoint(tmp_path / "tiny"))),
                       data=DataConfig(train_file=str(train)), rewards=[lambda p, c, **f: 1.0])
    assert ScoringConfig().concurrency == 16
    validate(apply_overrides(config, ["--scoring.concurrency=1"]))
    for value in ("0", "-3"):
        with pytest.raises(ConfigError, match=f"scoring.concurrency must be >= 1 .*got {value}"):
            validate(apply_overrides(config, [f"--scoring.concurrency={value}"]))
    with pytest.raises(ConfigError, match="scoring.concurrency"):
        apply_overrides(config, ["--scoring.concurrency=many"])
    config.scoring.concurrency = True  # a bool is not a count
    with pytest.raises(ConfigError, match="scoring.concurrency must be int"):
        validate(config)


def test_env_runner_scores_episodes_concurrently_and_reports_reward_seconds(vllm_engine):
    """On a real engine, 16 one-turn episodes with a 100 ms sync extra reward are each scored as
    they end, concurrently (several calls of it in progress at once): every sample gets env
    reward + extra, and the batch's reward_seconds covers the scoring (one 100 ms call at least)
    and never more than the request's wall time."""
    from titanrl.config import EnvConfig
    from titanrl.envs.base import Environment, StepResult
    from titanrl.rollout.env_runner import EnvRunner
    from titanrl.rollout.seeds import request_seed

    class OneTurn(Environment):
        async def reset(self, row):
            return row["prompt"]

        async def step(self, action):
            return StepResult(observation="", reward=0.5, done=True)

    peak = Peak()

    def grader(prompt, completion, **fields):
        with peak:
            time.sleep(0.1)
        return 1.0

    rc = RolloutConfig(group_size=4, sampling=SamplingConfig(max_new_tokens=4, temperature=1.0),
                       engine=EngineConfig(max_model_len=256))
    config = RunConfig(rollout=rc, env=EnvConfig(max_turns=1, max_total_tokens=64, sandbox_pool_size=0),
                       scoring=ScoringConfig(concurrency=16, timeout_s=5.0, error_value=-1.0))
    runner = EnvRunner(vllm_engine, lambda context: OneTurn(), config, [grader], 0)
    try:
        rows = [{"prompt": f"q{i}:"} for i in range(4)]
        batch = runner.generate(rows, request_seed(0, 0, 4, 1), first_group_id=0)
        assert [(s.reward, s.reward_error) for g in batch.groups for s in g.samples] == [(1.5, None)] * 16
        assert peak.most > 1
        assert batch.reward_seconds >= 0.1  # the grader's sleeps were counted (a lower bound only)
    finally:
        runner.close()
