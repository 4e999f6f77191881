"""The pieces of reward scoring: what counts as a reward, how a failed call is reported, helper threads.

A reward function is user code run thousands of times per step, so one bad call must cost
one sample, not the run: a reward that raises, runs past `timeout_s` or returns something
that is not a finite real number gives the sample `error_value` plus an error string the
driver logs (`Sample.reward_error`). The first failing reward of a sample decides: the sample
gets `error_value`, not the sum of the rewards that worked (a partial sum would rank it against
its group on a different scale), and the rewards after it are not called. The one scorer,
used by single-turn and episode rollouts alike, is `titanrl.rewards.batch_scoring.RewardScorer`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class RewardError(RuntimeError):
    """A reward function failed on one sample; the message names the function and the prompt."""


def row_fields(row: dict[str, Any], prompt_field: str) -> dict[str, Any]:
    """A dataset row minus its prompt: what rewards receive as keyword arguments."""
    return {k: v for k, v in row.items() if k != prompt_field}


def summed(total: float, prompt: str, error_value: float) -> tuple[float, str | None]:
    """`(total, None)`, or `(error_value, why)` when finite terms overflowed when summed."""
    if not math.isfinite(total):
        return error_value, f"rewards summed to {total} (prompt {prompt[:80]!r})"
    return total, None


def as_reward(value: Any) -> float:
    """`value` as a float if it is one finite real number; raises TypeError/ValueError otherwise.

    Accepted: int, float, anything registered as `numbers.Real` (numpy scalars such as
    np.float32, fractions.Fraction), 0-d numpy arrays and 0-d torch tensors of an integer or
    floating dtype. Rejected: bool (and boolean arrays/tensors) — as everywhere else in
    TitanRL's config and tool checks, a bool is not accepted as a number: a reward returning
    `answer == ref` is most often a predicate used where a score was meant, and `float(ok)`
    says the intent; also None, strings, sequences, multi-element or 1-element-but-not-0-d
    arrays and tensors, complex numbers, NaN and infinities.
    """
    number = _as_float(value)
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"returned {number}")
    return number


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("returned a bool; return a float (e.g. float(ok))")
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError as e:  # an int too large for a float
            raise ValueError(f"returned {_short(value)}, which does not fit in a float") from e
    # numpy and torch are only checked when already imported: otherwise `value` can't be theirs.
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray | np.generic):
        if value.ndim != 0 or value.dtype.kind not in "iuf":
            raise TypeError(
                f"returned a numpy value of shape {value.shape} and dtype {value.dtype}; "
                "return one real number (a 0-d integer or float array at most)"
            )
        return float(value.item())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"returned a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; "
                "return one real number (a 0-d integer or float tensor at most)"
            )
        return float(value.item())
    raise TypeError(f"returned {_short(value)} ({type(value).__name__}); it must return a real number")


def reward_name(fn: Any) -> str:
    """How error messages name a reward: its qualified name (of the wrapped function for a partial)."""
    target = getattr(fn, "func", fn)  # functools.partial
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__qualname__


def time_left(start: float, timeout_s: float | None) -> float | None:
    """What remains of a reward call's `timeout_s` that began at `start` (perf_counter)."""
    return None if timeout_s is None else max(timeout_s - (time.perf_counter() - start), 0.0)


def call_failed(fn: Any, prompt: str, e: Exception, start: float, timeout_s: float | None) -> RewardError:
    """The error of reward `fn`'s call that began at `start` and raised `e`: 'timed out' when `e`
    is the scorer's own deadline (or a TimeoutError raised at or after it), else 'raised'."""
    where = f"(prompt {prompt[:80]!r})"
    name = reward_name(fn)
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)) and (
        isinstance(e, Abandoned) or (timeout_s is not None and time.perf_counter() - start >= timeout_s)
    ):
        error = RewardError(f"reward {name} timed out after {float(timeout_s)} s {where}")
        error.__suppress_context__ = True  # as `from None`: the deadline's own traceback says nothing
        return error
    error = RewardError(f"reward {name} raised {type(e).__name__}: {_short(e)} {where}")
    error.__cause__ = e  # as `from e`
    return error


def checked(fn: Any, prompt: str, value: Any) -> float:
    """`value` as a reward (see `as_reward`), or a RewardError naming `fn` and why it is not one."""
    try:
        return as_reward(value)
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward {reward_name(fn)} {e} (prompt {prompt[:80]!r})") from None


class Abandoned(TimeoutError):
    """The helper thread running a sync reward was still busy at the deadline."""


def is_async(fn: Any) -> bool:
    # Callable objects with an `async def __call__` count too.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class Job:
    """One sync reward call handed to a helper thread."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        """How long the call itself took (without the hand-offs to and from the helper)."""
        self.done = threading.Event()
        self.on_done: Callable[[], None] | None = None
        """Called in the helper thread once the call returned (wakes an event loop); must not raise."""

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # even SystemExit: in a helper thread it would otherwise vanish
            self.error = e
        self.seconds = time.perf_counter() - start
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class RewardThread:
    """A daemon thread running one calling thread's sync rewards, one at a time.

    Reused across calls (starting a thread per call costs ~10x the handoff); a daemon, so an
    abandoned one never blocks the process from exiting.
    """

    def __init__(self, name: str = "titanrl-reward") -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # None: stop
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            job.run()


def loop_running() -> bool:
    """True inside a running asyncio event loop (where a blocking run_until_complete would fail)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def awaited(value: Any) -> Any:
    # wait_for needs a coroutine or future; a reward may return any awaitable.
    return await value


def _short(value: Any, limit: int = 300) -> str:
    text = (str(value) or "(no message)") if isinstance(value, BaseException) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def is_correct(reward: float, error: str | None, correct_threshold: float) -> bool:
    """Whether a scored completion counts as correct: reward >= eval.correct_threshold and no reward error."""
    return reward >= correct_threshold and error is None


def eval_summary(
    rewards: list[float], correct_threshold: float, policy_version: int, errors: list[str | None] | None = None
) -> dict[str, Any]:
    """What a worker's `evaluate` returns to the driver; a sample whose reward errored is never correct."""
    errors = errors if errors is not None else [None] * len(rewards)
    return {
        "rewards": rewards,
        "correct": sum(is_correct(r, e, correct_threshold) for r, e in zip(rewards, errors, strict=True)),
        "reward_errors": sum(e is not None for e in errors),
        "policy_version": policy_version,
    }
