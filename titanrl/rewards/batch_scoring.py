"""Scoring many samples at once, so that a slow grader costs one call's time, not one per sample.

`RewardScorer.score` gives each sample the weighted sum of the rewards, or `error_value` and why
(`titanrl.rewards.scoring`), in input order, and what a sample gets does not depend on the
batch it is in. The samples run concurrently: every sample is a task on one event loop, so `async` rewards of all samples are awaited
together, and sync rewards run on at most `concurrency` pooled helper threads (a reward whose
calls take microseconds makes all of a batch's calls on one helper, each with its own deadline:
`FAST_CALL_S`). The rewards of
one sample still run one after another (the first failure decides, later ones are not called).

A batched reward (`titanrl.batched_reward`) is called once for all samples still standing when
its turn in the list comes, with lists; the per-sample rewards before it finish first, so
consecutive per-sample rewards form one concurrent stage and each batched reward its own.
`score_results` also returns each reward's own value and time (`titanrl.types.RewardTerms`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from titanrl.rewards.named import NamedReward, named_rewards
from titanrl.rewards.scoring import (
    Abandoned,
    Job,
    RewardError,
    RewardThread,
    awaited,
    call_failed,
    checked,
    is_async,
    loop_running,
    summed,
    time_left,
)
from titanrl.types import RewardTerms


HELPER_NAME = "titanrl-reward-pool"
"""The name of a scorer's helper threads."""
FAST_CALL_S = 1e-3
"""A sync reward whose last `FAST_STREAK` calls took less than this on average is "fast": a stage
of it on many samples runs back to back on one helper thread (`_fast_stage`), one hand-off each
way for the lot instead of one per sample (on the arithmetic example, whose reward takes
microseconds, the hand-offs took the GIL from the engine often enough to slow generation ~10 %).
Slow calls (a sandbox, a grader service) keep one helper per sample: run back to back they
would add up. Averaged, so a call the GIL switch interval happened to stretch does not count."""
FAST_STREAK = 32


class ToScore(NamedTuple):
    """One completion to score: what each reward function is called with."""

    prompt: str
    """The prompt text (rewards' first argument)."""
    completion: str
    """The completion text (rewards' second argument)."""
    fields: dict[str, Any]
    """The dataset row's other fields, passed as keyword arguments."""


class RewardResult(NamedTuple):
    """One scored sample: its total reward, why it failed (None when it did not), and its terms."""

    reward: float
    """The weighted sum of the rewards, or the scorer's error_value."""
    error: str | None
    """The first failing reward's error (names the reward and the prompt)."""
    terms: RewardTerms
    """Each reward's own value and time on this sample."""


class _Running:
    """A sample's reward while its rewards are called: what they gave so far."""

    def __init__(self) -> None:
        self.total, self.error, self.terms = 0.0, None, RewardTerms()

    def add(self, reward: NamedReward, value: float) -> None:
        self.terms.values[reward.name] = value
        self.total += reward.weight * value

    def fail(self, reward: NamedReward, error: str) -> None:
        self.error, self.terms.failed = error, reward.name


class RewardScorer:
    """Sums `rewards` on many completions concurrently; owns the helper threads for sync rewards.

    Used by one thread at a time (a rollout worker's), from one event loop at a time: `score`
    runs on the scorer's own loop, `score_async` on the caller's. `close()` ends the helpers.
    """

    def __init__(self, rewards: list[Callable[..., Any]], *, timeout_s: float | None, error_value: float,
                 concurrency: int = 16, weights: Sequence[float] | None = None) -> None:
        """`timeout_s`: limit of one reward call (None: no limit; a batched reward's call is one
        call for its whole batch); `error_value`: the reward of a sample whose reward failed;
        `concurrency`: sync reward calls at once; `weights`: one per reward (RunConfig.reward_weights),
        None: all 1.

        A sync reward that times out is abandoned: a Python thread cannot be killed, so it keeps
        running (and taking the GIL while it computes) until it returns on its own. Async rewards
        are cancelled through `asyncio.wait_for`; one that blocks the loop (a sync sleep inside
        `async def`) cannot be interrupted.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.rewards, self.timeout_s, self.error_value = rewards, timeout_s, error_value
        self.named = named_rewards(rewards, weights)
        self.stages = _stages(self.named)
        self.concurrency = concurrency
        self.seconds = 0.0
        """Wall time during which at least one sample was being scored, summed over the scorer's life."""
        self._scoring, self._since = 0, 0.0  # score_async calls in progress; when the first began
        self._helpers = _Helpers(concurrency)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # An inline call, kept for rewards that need the calling thread (e.g. signal-based
        # timeouts of their own): only when there is no timeout and one call at a time is asked for.
        self._inline = timeout_s is None and concurrency == 1

        self._recent_seconds: dict[Callable[..., Any], deque[float]] = {}
        """Per sync reward function, how long its last FAST_STREAK calls took (hand-offs excluded)."""
        self._forming: dict[Callable[..., Any], _FastBatch] = {}
        """Per fast reward function, the batch its fast stages join in this turn of the loop."""
        self._fast_batches: set[asyncio.Task[None]] = set()

    def score(self, items: Sequence[ToScore]) -> list[tuple[float, str | None]]:
        """`(reward, error)` for each item (error None when every reward worked), in order, scored concurrently."""
        return [(r.reward, r.error) for r in self.score_results(items)]

    async def score_async(self, items: Sequence[ToScore]) -> list[tuple[float, str | None]]:
        """`score` on the running event loop; concurrent calls share the helper threads."""
        return [(r.reward, r.error) for r in await self.score_results_async(items)]

    def score_results(self, items: Sequence[ToScore]) -> list[RewardResult]:
        """`score` with each reward's own value and time (`RewardResult`)."""
        if self._closed:
            raise RuntimeError("the reward scorer is closed")
        if loop_running():
            raise RuntimeError("RewardScorer.score must not be called from inside a running event loop; "
                               "await score_async instead")
        if self._loop is None:
            # Long-lived: the async rewards of a batch, and of later batches, share it.
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.score_results_async(items))

    async def score_results_async(self, items: Sequence[ToScore]) -> list[RewardResult]:
        """`score_results` on the running event loop; concurrent calls share the helper threads."""
        if self._scoring == 0:
            self._since = time.perf_counter()
        self._scoring += 1
        try:
            running = [_Running() for _ in items]
            for stage in self.stages:
                alive = [i for i, r in enumerate(running) if r.error is None]
                if not alive:
                    break
                if stage[0].batched:
                    await self._batch(stage[0], [items[i] for i in alive], [running[i] for i in alive])
                elif len(alive) > 1 and self._is_fast(stage):
                    await self._fast_stage(stage[0], [items[i] for i in alive], [running[i] for i in alive])
                else:
                    await asyncio.gather(*(self._sample(stage, items[i], running[i]) for i in alive))
            return [self._result(item, r) for item, r in zip(items, running, strict=True)]
        finally:
            self._scoring -= 1
            if self._scoring == 0:
                self.seconds += time.perf_counter() - self._since

    def close(self) -> None:
        """Stops idle helper threads and closes the scorer's loop (abandoned helpers end on their own)."""
        self._closed = True
        self._helpers.close()
        if self._loop is not None and not self._loop.is_closed():
            leftover = asyncio.all_tasks(self._loop)  # tasks a reward started and left behind
            for task in leftover:
                task.cancel()
            if leftover:
                self._loop.run_until_complete(asyncio.wait(leftover, timeout=1.0))
            self._loop.close()

    def _result(self, item: ToScore, running: _Running) -> RewardResult:
        if running.error is not None:
            return RewardResult(self.error_value, running.error, running.terms)
        total, error = summed(running.total, item.prompt, self.error_value)
        return RewardResult(total, error, running.terms)

    async def _sample(self, stage: list[NamedReward], item: ToScore, running: _Running) -> None:
        """A stage of per-sample rewards on one sample, one after another; the first failure ends it."""
        for reward in stage:
            try:
                running.add(reward, await self._one(reward, item, running.terms.seconds))
            except RewardError as e:
                running.fail(reward, str(e))
                return

    async def _one(self, reward: NamedReward, item: ToScore, seconds: dict[str, float]) -> float:
        """One reward call's value (its time goes to `seconds`); a failure becomes a `RewardError`
        (`call_failed`, `checked`)."""
        start = time.perf_counter()
        try:
            value, seconds[reward.name] = await self._call(reward.fn, (item.prompt, item.completion), item.fields,
                                                           item.prompt)
        except RewardError:
            seconds[reward.name] = time.perf_counter() - start
            raise
        return checked(reward.fn, item.prompt, value)

    def _timed(self, fn: Callable[..., Any], seconds: float) -> None:
        """Counts a sync call of `fn` that took `seconds` itself (hand-offs to a helper excluded)."""
        self._recent_seconds.setdefault(fn, deque(maxlen=FAST_STREAK)).append(seconds)

    def _is_fast(self, stage: list[NamedReward]) -> bool:
        """One sync reward, called on helper threads, that has been fast (FAST_CALL_S) lately."""
        (reward, *others) = stage
        recent = self._recent_seconds.get(reward.fn, ())
        return (not others and not self._inline and not is_async(reward.fn) and len(recent) == FAST_STREAK
                and sum(recent) < FAST_CALL_S * FAST_STREAK)

    async def _fast_stage(self, reward: NamedReward, items: list[ToScore], running: list[_Running]) -> None:
        """A fast sync reward on every item, back to back on one helper thread, together with the
        other fast stages of it that start in the same turn of the event loop (`_FastBatch`: the
        groups one engine step finishes are scored with one hand-off, not one each). Each call
        keeps its own deadline: a watchdog on the loop abandons the helper once the call it is
        running has taken `timeout_s` (that sample times out, as alone), and the items after it
        are scored one per helper, as usual."""
        batch, offset = self._join_fast_batch(reward.fn, items)
        returned = await asyncio.shield(batch.finished)  # a caller that goes away leaves the others theirs
        results = batch.calls.results[offset: max(offset, min(returned, offset + len(items)))]
        for item, r, (value, error, took) in zip(items, running, results, strict=False):
            r.terms.seconds[reward.name] = took
            self._timed(reward.fn, took)
            # Its deadline as if it had just returned: a later call in the batch may have hung.
            start = time.perf_counter() - took
            try:
                if error is not None:
                    raise error
                if inspect.isawaitable(value):  # a sync callable handing back an awaitable
                    value = await asyncio.wait_for(awaited(value), time_left(start, self.timeout_s))
                    r.terms.seconds[reward.name] = time.perf_counter() - start
            except Exception as e:
                r.fail(reward, str(call_failed(reward.fn, item.prompt, e, start, self.timeout_s)))
                continue
            try:
                r.add(reward, checked(reward.fn, item.prompt, value))
            except RewardError as e:
                r.fail(reward, str(e))
        done = len(results)
        if done < len(items):  # the helper was abandoned: on our item `done`, or on an earlier caller's
            if offset + done == returned:  # ours hung
                start = batch.calls.current_start
                r = running[done]
                r.terms.seconds[reward.name] = time.perf_counter() - start
                self._timed(reward.fn, math.inf)
                r.fail(reward, str(call_failed(reward.fn, items[done].prompt, Abandoned(), start, self.timeout_s)))
                done += 1
            await asyncio.gather(*(self._sample([reward], item, r) for item, r in
                                   zip(items[done:], running[done:], strict=True)))

    def _join_fast_batch(self, fn: Callable[..., Any], items: list[ToScore]) -> tuple[_FastBatch, int]:
        """The batch of `fn`'s calls forming in this turn of the loop (started at its end) with
        `items` added; returns it and where `items` begin in it."""
        batch = self._forming.get(fn)
        if batch is None:
            batch = self._forming[fn] = _FastBatch(CallBatch(fn, []), asyncio.get_running_loop().create_future())
            asyncio.get_running_loop().call_soon(self._start_fast_batch, fn)
        offset = len(batch.calls.calls)
        batch.calls.calls.extend(((item.prompt, item.completion), item.fields) for item in items)
        return batch, offset

    def _start_fast_batch(self, fn: Callable[..., Any]) -> None:
        batch = self._forming.pop(fn)
        task = asyncio.get_running_loop().create_task(self._run_fast_batch(batch))
        self._fast_batches.add(task)  # (the loop keeps only weak references to tasks)
        task.add_done_callback(self._fast_batches.discard)

    async def _run_fast_batch(self, batch: _FastBatch) -> None:
        try:
            helper = await self._helpers.acquire()
            loop = asyncio.get_running_loop()
            finished: asyncio.Future[None] = loop.create_future()
            batch.calls.on_done = lambda: _wake_soon(loop, finished)
            helper.jobs.put(batch.calls)  # type: ignore[arg-type]  (a RewardThread runs anything with run())
            batch.finished.set_result(await self._watch(batch.calls, finished, helper))
        except asyncio.CancelledError:
            batch.finished.cancel()
            raise
        except Exception as e:  # every caller waiting on the batch gets it
            batch.finished.set_exception(e)

    async def _watch(self, calls: CallBatch, finished: asyncio.Future[None], helper: RewardThread) -> int:
        """Waits for `calls`; returns how many of them returned (all, unless the helper was
        abandoned at a call's deadline)."""
        try:
            while not finished.done():
                if self.timeout_s is None:
                    await finished
                    break
                started = calls.current_start
                await asyncio.wait({finished}, timeout=max(0.0, started + self.timeout_s - time.perf_counter()))
                if (not finished.done() and calls.current_start == started
                        and time.perf_counter() - started >= self.timeout_s):
                    calls.stop = True  # the calls after the hung one are not made on that thread
                    done = len(calls.results)
                    self._helpers.abandon(helper)
                    return done
        except BaseException:  # this task was cancelled: the calls go on without us
            calls.stop = True
            self._helpers.abandon(helper)
            raise
        self._helpers.release(helper)
        return len(calls.calls)

    async def _batch(self, reward: NamedReward, items: list[ToScore], running: list[_Running]) -> None:
        """A batched reward's one call on `items`; a failed call fails them all, a bad value its sample."""
        prompt, start = items[0].prompt, time.perf_counter()
        try:
            values, took = await self._call(reward.fn, ([i.prompt for i in items], [i.completion for i in items]),
                                            _columns(items), prompt)
            values = _one_per_sample(reward, values, len(items), prompt)
        except RewardError as e:
            for r in running:
                r.terms.seconds[reward.name] = (time.perf_counter() - start) / len(items)
                r.fail(reward, str(e))
            return
        for item, r, value in zip(items, running, values, strict=True):
            r.terms.seconds[reward.name] = took / len(items)
            try:
                r.add(reward, checked(reward.fn, item.prompt, value))
            except RewardError as e:
                r.fail(reward, str(e))

    async def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                    prompt: str) -> tuple[Any, float]:
        """`fn(*args, **kwargs)` within the timeout and the seconds it took; a failure becomes a
        `RewardError` naming `fn` and `prompt` (`call_failed`)."""
        timeout_s, start = self.timeout_s, time.perf_counter()
        try:
            if is_async(fn):
                value = await asyncio.wait_for(awaited(fn(*args, **kwargs)), timeout_s)
            else:
                # The deadline counts from when a helper takes the call, not from the wait for a
                # free one, so a queue of slow samples never times out a fast one.
                helper = None if self._inline else await self._helpers.acquire()
                start = time.perf_counter()
                value = await self._call_sync(helper, fn, args, kwargs)
                if inspect.isawaitable(value):  # a sync callable handing back an awaitable
                    value = await asyncio.wait_for(awaited(value), time_left(start, timeout_s))
        except Exception as e:
            raise call_failed(fn, prompt, e, start, timeout_s)  # it sets the cause itself
        return value, time.perf_counter() - start

    async def _call_sync(self, helper: RewardThread | None, fn: Callable[..., Any], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        """A sync reward's value, called on `helper` (which this returns to the pool or abandons),
        or inline when `helper` is None."""
        if helper is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        job = Job(fn, args, kwargs)
        job.on_done = lambda: _wake_soon(loop, finished)
        helper.jobs.put(job)
        try:
            await asyncio.wait_for(finished, self.timeout_s)
        except TimeoutError:  # our deadline (the reward's own errors come back in job.error)
            self._helpers.abandon(helper)
            self._timed(fn, math.inf)
            raise Abandoned from None
        except BaseException:  # this task was cancelled: the call goes on without us
            self._helpers.abandon(helper)
            raise
        self._helpers.release(helper)
        self._timed(fn, job.seconds)
        if job.error is not None:
            raise job.error
        return job.value


def _stages(rewards: list[NamedReward]) -> list[list[NamedReward]]:
    """Consecutive per-sample rewards as one stage, each batched reward as a stage of its own."""
    stages: list[list[NamedReward]] = []
    for reward in rewards:
        if reward.batched or not stages or stages[-1][0].batched:
            stages.append([reward])
        else:
            stages[-1].append(reward)
    return stages


def _columns(items: list[ToScore]) -> dict[str, list[Any]]:
    """The items' fields as lists aligned with the items (None where an item lacks the field)."""
    keys = list(dict.fromkeys(k for item in items for k in item.fields))
    return {k: [item.fields.get(k) for item in items] for k in keys}


def _one_per_sample(reward: NamedReward, values: Any, n: int, prompt: str) -> list[Any]:
    """A batched reward's return value as a list of `n` values, or a RewardError saying why not."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise RewardError(f"batched reward {reward.name} returned {type(values).__name__}; it must return a list "
                          f"of {n} rewards, one per sample (first prompt {prompt[:80]!r})")
    try:
        values = list(values)
    except TypeError:  # a 0-d array or tensor
        raise RewardError(f"batched reward {reward.name} returned one value; it must return a list of {n} "
                          f"rewards, one per sample (first prompt {prompt[:80]!r})") from None
    if len(values) != n:
        raise RewardError(f"batched reward {reward.name} returned {len(values)} rewards for {n} samples "
                          f"(first prompt {prompt[:80]!r})")
    return values


class _FastBatch(NamedTuple):
    """The calls of one fast reward from every fast stage that started in one turn of the loop."""

    calls: CallBatch
    finished: asyncio.Future[int]
    """How many of `calls` returned (all, unless the helper was abandoned on the next one)."""


class CallBatch:
    """Calls of one sync reward on many samples, made back to back by one helper thread."""

    def __init__(self, fn: Callable[..., Any], calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        self.fn, self.calls = fn, calls
        self.results: list[tuple[Any, BaseException | None, float]] = []
        """(value, error, seconds) of each call made so far, in order."""
        self.current_start = time.perf_counter()
        """When the call being made now began (the watchdog's deadline counts from it)."""
        self.stop = False
        """Set by the loop when it abandons this batch: the calls not yet begun are not made."""
        self.on_done: Callable[[], None] | None = None

    def run(self) -> None:
        for args, kwargs in self.calls:
            if self.stop:
                return
            start = self.current_start = time.perf_counter()
            try:
                value, error = self.fn(*args, **kwargs), None
            except BaseException as e:  # noqa: BLE001 (even SystemExit: in a helper thread it would vanish)
                value, error = None, e
            self.results.append((value, error, time.perf_counter() - start))
        if self.on_done is not None:
            self.on_done()


class _Helpers:
    """At most `size` busy helper threads; idle ones are reused, abandoned ones replaced.

    Why not a `ThreadPoolExecutor`: a Python thread cannot be killed, so a reward that hangs
    past its timeout keeps its thread. In an executor that thread stays counted, and a few hung
    calls would shrink the pool to nothing for the rest of the run; its threads are also joined
    at interpreter exit, so one hung grader would keep the worker process from exiting. Here an
    abandoned helper leaves the pool at once (it is told to exit after its call returns) and a
    fresh one takes its place, and helpers are daemon threads (`RewardThread`). The cost is
    one leaked thread per call still hung.

    Only touched from the event loop's thread, so no lock is needed.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[RewardThread] = []
        self._busy = 0  # helpers handed out and not yet released or abandoned
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def acquire(self) -> RewardThread:
        if self._closed:
            raise RuntimeError("the reward scorer is closed")
        while self._busy >= self.size:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                else:  # woken and cancelled at once: hand the free slot to the next waiter
                    self._wake_one()
                raise
        self._busy += 1
        return self._idle.pop() if self._idle else RewardThread(HELPER_NAME)

    def release(self, helper: RewardThread) -> None:
        self._busy -= 1
        if self._closed:
            helper.jobs.put(None)
        else:
            self._idle.append(helper)
        self._wake_one()

    def abandon(self, helper: RewardThread) -> None:
        helper.jobs.put(None)  # it exits once its call returns
        self._busy -= 1
        self._wake_one()

    def close(self) -> None:
        self._closed = True
        for helper in self._idle:
            helper.jobs.put(None)
        self._idle.clear()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _wake_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    """Runs in a helper thread: resolves `future` on its loop, unless the loop is gone already
    (the call was abandoned and the scorer closed before it returned)."""
    try:
        loop.call_soon_threadsafe(_resolve, future)
    except RuntimeError:  # loop closed
        pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # wait_for cancels it at the deadline
        future.set_result(None)

