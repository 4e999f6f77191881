"""Scoring many samples at once, so that a slow grader costs one call's time, not one per sample.

`RewardScorer.score` gives each sample the sum of the rewards, or `error_value` and why
(`titanrl.rewards.scoring`), in input order, and what a sample gets does not depend on the
batch it is in. The samples run concurrently: every sample is a task on one event loop, so `async` rewards of all samples are awaited
together, and sync rewards run on at most `concurrency` pooled helper threads. The rewards of
one sample still run one after another (the first failure decides, later ones are not called).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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


HELPER_NAME = "titanrl-reward-pool"
"""The name of a scorer's helper threads."""


class ToScore(NamedTuple):
    """One completion to score: what each reward function is called with."""

    prompt: str
    """The prompt text (rewards' first argument)."""
    completion: str
    """The completion text (rewards' second argument)."""
    fields: dict[str, Any]
    """The dataset row's other fields, passed as keyword arguments."""


class RewardScorer:
    """Sums `rewards` on many completions concurrently; owns the helper threads for sync rewards.

    Used by one thread at a time (a rollout worker's), from one event loop at a time: `score`
    runs on the scorer's own loop, `score_async` on the caller's. `close()` ends the helpers.
    """

    def __init__(self, rewards: list[Callable[..., Any]], *, timeout_s: float | None, error_value: float,
                 concurrency: int = 16) -> None:
        """`timeout_s`: limit of one reward call (None: no limit); `error_value`: the reward of a sample
        whose reward failed; `concurrency`: sync reward calls at once.

        A sync reward that times out is abandoned: a Python thread cannot be killed, so it keeps
        running (and taking the GIL while it computes) until it returns on its own. Async rewards
        are cancelled through `asyncio.wait_for`; one that blocks the loop (a sync sleep inside
        `async def`) cannot be interrupted.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.rewards, self.timeout_s, self.error_value = rewards, timeout_s, error_value
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

    def score(self, items: Sequence[ToScore]) -> list[tuple[float, str | None]]:
        """`(reward, error)` for each item (error None when every reward worked), in order, scored concurrently."""
        if self._closed:
            raise RuntimeError("the reward scorer is closed")
        if loop_running():
            raise RuntimeError("RewardScorer.score must not be called from inside a running event loop; "
                               "await score_async instead")
        if self._loop is None:
            # Long-lived: the async rewards of a batch, and of later batches, share it.
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.score_async(items))

    async def score_async(self, items: Sequence[ToScore]) -> list[tuple[float, str | None]]:
        """`score` on the running event loop; concurrent calls share the helper threads."""
        if self._scoring == 0:
            self._since = time.perf_counter()
        self._scoring += 1
        try:
            return list(await asyncio.gather(*(self._sample(item) for item in items)))
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

    async def _sample(self, item: ToScore) -> tuple[float, str | None]:
        total = 0.0
        for fn in self.rewards:
            try:
                total += await self._one(fn, item)
            except RewardError as e:
                return self.error_value, str(e)
        return summed(total, item.prompt, self.error_value)

    async def _one(self, fn: Callable[..., Any], item: ToScore) -> float:
        """One reward call's value; a failure becomes a `RewardError` (`call_failed`, `checked`)."""
        timeout_s, start = self.timeout_s, time.perf_counter()
        try:
            if is_async(fn):
                value = await asyncio.wait_for(awaited(fn(item.prompt, item.completion, **item.fields)), timeout_s)
            else:
                # The deadline counts from when a helper takes the call, not from the wait for a
                # free one, so a queue of slow samples never times out a fast one.
                helper = None if self._inline else await self._helpers.acquire()
                start = time.perf_counter()
                value = await self._call_sync(helper, fn, item)
                if inspect.isawaitable(value):  # a sync callable handing back an awaitable
                    value = await asyncio.wait_for(awaited(value), time_left(start, timeout_s))
        except Exception as e:
            raise call_failed(fn, item.prompt, e, start, timeout_s)  # it sets the cause itself
        return checked(fn, item.prompt, value)

    async def _call_sync(self, helper: RewardThread | None, fn: Callable[..., Any], item: ToScore) -> Any:
        """A sync reward's value, called on `helper` (which this returns to the pool or abandons),
        or inline when `helper` is None."""
        if helper is None:
            return fn(item.prompt, item.completion, **item.fields)
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()
        job = Job(fn, (item.prompt, item.completion), item.fields)
        job.on_done = lambda: _wake_soon(loop, finished)
        helper.jobs.put(job)
        try:
            await asyncio.wait_for(finished, self.timeout_s)
        except TimeoutError:  # our deadline (the reward's own errors come back in job.error)
            self._helpers.abandon(helper)
            raise Abandoned from None
        except BaseException:  # this task was cancelled: the call goes on without us
            self._helpers.abandon(helper)
            raise
        self._helpers.release(helper)
        if job.error is not None:
            raise job.error
        return job.value


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

