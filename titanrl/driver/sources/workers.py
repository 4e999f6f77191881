"""The rollout workers of a run, the weight transport that feeds them, and the replacement of dead ones.

Both rollout sources (`lockstep`, `continuous`) keep their worker actors in a `WorkerPool`. It
opens the trainer-to-workers transport (`titanrl.weight_sync.WeightSync`), pushes versions, and
when a worker's actor dies (its process killed, out of memory) starts a new actor in the same
slot that loads the trainer's current weights before it serves anything: that load is the
first call queued on it, and Ray runs a worker's calls in order (an async worker's
`generate_group` also waits for its `min_version`). 'shared_memory' and 'broadcast' fix their
members when they open, so for them the transport is closed and opened again with the
replacement in it. The source then hands the replacement whatever the dead actor had not
finished (`LockstepRollouts`: its part of every queued request, same rows and seeds;
`ContinuousRollouts`: its groups).

A slot whose actor dies `max_deaths_in_a_row` times without finishing anything in between
stops the run with `RolloutWorkersFailed` (a crashing reward or environment, memory that is
never enough); `max_deaths_in_a_row=1` turns replacement off (the first death stops the run).

A 'broadcast' push under way when a member dies fails on every member within seconds (the
members whose push fails leave the group; a silent one is bounded by the plan's
`stream_timeout_s`: titanrl/weight_sync/broadcast.py). Known limit: a member lost, without its
connections closing, before it reached a push's first exchange holds that exchange for up to the
plan's `timeout_s` (gloo notices a killed process at once; a machine that vanished, not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from titanrl.driver.out_of_memory import memory_hint
from titanrl.driver.sources.base import RolloutWorkersFailed
from titanrl.weight_sync import WeightPush, WeightSync

MAX_DEATHS_IN_A_ROW = 3
"""A worker slot whose actor dies this many times in a row (finishing nothing in between) stops the run."""

log = logging.getLogger("titanrl")

T = TypeVar("T")


@dataclass(frozen=True)
class FinishedPush:
    """A push every worker has loaded, as the metrics report it."""

    wall_s: float
    """From the push's start until the driver saw every worker done (time/weight_sync_s): in a
    continuous run this includes the wait for a worth-while moment between engine steps
    (`rollout.defer_weight_loads`), so an upper bound."""
    load_s: float
    """The slowest worker's own time for the load itself (the transport's transfer included), between
    two engine steps (time/weight_load_s)."""


@dataclass
class PoolPush(WeightPush):
    """A push whose `wait` survives a worker's death: the source replaces that worker, and the
    replacement loads the current weights itself. Any other failure is raised."""

    def wait(self) -> float:
        import ray
        from ray.exceptions import RayActorError

        died, errors = False, []
        for ref in self.refs:
            try:
                ray.get(ref)
            except RayActorError:
                died = True
            except Exception as e:  # broadcast: the live members fail too when one died
                errors.append(e)
        if errors and not died:
            raise errors[0]
        return time.perf_counter() - self.started


def describe(error: BaseException) -> str:
    """`Type: first line of the message`, for one-line log messages."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class WorkerPool:
    """Worker slots 0..N-1, each running one rollout worker actor, and the weight transport to them."""

    def __init__(self, make_worker: Callable[[Any], Any], num_workers: int,
                 max_deaths_in_a_row: int = MAX_DEATHS_IN_A_ROW) -> None:
        """`make_worker(home)` starts a slot's actor in its home: the slot's index (its bundle of the
        run's placement) for the first `num_workers` slots, whatever `add` was given for the others."""
        self.make_worker, self.max_deaths_in_a_row = make_worker, max_deaths_in_a_row
        self.homes: list[Any] = list(range(num_workers))
        """Where each slot's actor runs (`make_worker`'s argument)."""
        self.workers: list[Any] = [make_worker(home) for home in self.homes]
        """The live actor of each slot; a replacement takes its slot's place."""
        self.deaths_in_a_row = [0] * num_workers
        self.restarts = 0
        """Replacements started so far (`workers/restarts`)."""
        self.trainer: Any = None
        self.sync: WeightSync | None = None
        self.transport = "object_store"
        self.plan_options: dict[str, Any] = {}
        self.version = 0
        """The newest version pushed: the weights the trainer holds between steps."""
        self.pushes: list[WeightPush] = []
        """Pushes not yet seen loaded by every worker, oldest first."""

    # ------------------------------------------------------------------ weights

    def open_weight_sync(self, trainer: Any, transport: str, **plan_options: Any) -> None:
        """Connects `trainer` to every worker with `transport` (`rollout.weight_transport`);
        `plan_options` are `WeightSyncPlan` fields (backend, host, ...), kept for re-opening."""
        self.trainer, self.transport, self.plan_options = trainer, transport, dict(plan_options)
        self.sync = WeightSync.open(trainer, self.workers, transport, **self.plan_options)

    def push(self, version: int) -> PoolPush:
        """Sends the trainer's weights to every worker as `version` (non-blocking)."""
        if self.sync is None:
            raise RuntimeError("open_weight_sync before the first push")
        push = self.sync.push(version)
        self.version = version
        self.pushes.append(PoolPush(push.loads, push.sent, push.started))
        return self.pushes[-1]

    def finished_pushes(self) -> list[FinishedPush | None]:
        """Removes the pushes every worker has answered, oldest first, stopping at the first one
        still running; each as its times, or None where some worker failed it (a death)."""
        import ray

        done: list[FinishedPush | None] = []
        while self.pushes:
            push = self.pushes[0]
            ready, _ = ray.wait(push.refs, num_returns=len(push.refs), timeout=0)
            if len(ready) < len(push.refs):
                break
            self.pushes.pop(0)
            try:
                *loads, _sent = ray.get(push.refs)
                done.append(FinishedPush(time.perf_counter() - push.started, max(loads, default=0.0)))
            except Exception:  # a worker that died meanwhile; its replacement loads on its own
                done.append(None)
        return done

    def close(self) -> None:
        """Closes the weight transport (shared memory, broadcast group); the actors stay up."""
        if self.sync is not None:
            self.sync.close()

    # ------------------------------------------------------------------ failures

    def served(self, i: int) -> None:
        """Slot i finished something: its deaths no longer count as 'in a row'."""
        self.deaths_in_a_row[i] = 0

    def call(self, i: int, method: str, *args: Any) -> Any:
        """`ray.get` of `method(*args)` on slot i's worker, on a replacement if it dies meanwhile."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            actor = self.workers[i]
            try:
                result = ray.get(getattr(actor, method).remote(*args))
            except RayActorError as e:
                self.replace(i, actor, e)
                continue
            self.served(i)
            return result

    def replace(self, i: int, dead: Any, error: BaseException) -> bool:
        """Slot i's actor `dead` died of `error`: starts a replacement holding the current weights
        and, for 'shared_memory' / 'broadcast', re-forms the transport with it. Returns False
        (and does nothing) when slot i already runs another actor. Raises RolloutWorkersFailed
        past the limit of deaths in a row."""
        from ray.exceptions import RayActorError

        if self.workers[i] is not dead:
            return False
        while True:
            self.deaths_in_a_row[i] += 1
            if self.deaths_in_a_row[i] >= self.max_deaths_in_a_row:
                raise RolloutWorkersFailed(self._stop_message(i, error))
            self.restarts += 1
            log.info(f"rollout worker {i} died ({describe(error)}); starting a replacement")
            try:
                self._start_replacement(i)
                return True
            except RayActorError as e:  # the replacement died too, starting up
                error = e

    def _stop_message(self, i: int, error: BaseException) -> str:
        if self.max_deaths_in_a_row <= 1:
            return f"rollout worker {i} died ({describe(error)}) and replacement is off" + memory_hint(error)
        return (f"rollout worker {i} died {self.deaths_in_a_row[i]} times in a row without finishing anything "
                f"(last: {describe(error)}); check its log above (out of memory? a crashing reward or environment?)"
                + memory_hint(error))

    def _start_replacement(self, i: int) -> None:
        import ray

        if self.sync is None or self.trainer is None:
            raise RuntimeError("open_weight_sync before a worker can be replaced")
        try:
            ray.kill(self.workers[i])
        except Exception:  # already gone
            pass
        missed = self._settle_pushes() if self.transport != "object_store" else set()
        self.workers[i] = self.make_worker(self.homes[i])
        if self.transport == "object_store":
            self.sync.workers[i] = self.workers[i]
            self.workers[i].open_weight_sync.remote(self.sync.plan, i + 1)
        else:
            self._reopen()  # RayActorError if the replacement died starting: `replace` starts another
        self._load_current_weights(missed | {i})

    def _reopen(self) -> None:
        """'shared_memory' / 'broadcast' fix their members when they open: open again with today's."""
        assert self.sync is not None
        self.sync.close()
        self.sync = WeightSync.open(self.trainer, self.workers, self.transport, **self.plan_options)

    def reload(self, i: int) -> None:
        """Slot i answered with older weights than the newest push (its load of that push failed: a
        broadcast with a dead member fails for every member): it loads the current weights directly,
        through the object store, before anything queued on it after this."""
        self._load_current_weights({i})

    def _load_current_weights(self, slots: set[int]) -> None:
        # The trainer is between steps here (the source is waiting for rollouts): it holds self.version.
        weights = self.trainer.state_dict_for_push.remote()
        for j in sorted(slots):
            self.workers[j].update_weights.remote(weights, self.version)

    # ------------------------------------------------------------------ elastic size

    def add(self, home: Any) -> int:
        """A new slot whose actor starts in `home` (`rollout.elastic`: a node joined) and holds the
        current weights before it serves anything; returns its index."""
        if self.sync is None or self.trainer is None:
            raise RuntimeError("open_weight_sync before a worker can be added")
        missed = self._settle_pushes() if self.transport != "object_store" else set()
        self.homes.append(home)
        self.workers.append(self.make_worker(home))
        self.deaths_in_a_row.append(0)
        i = len(self.workers) - 1
        if self.transport == "object_store":
            self.sync.add_receiver(self.workers[i])
        else:
            self._reopen()
        self._load_current_weights(missed | {i})
        return i

    def remove(self, i: int) -> Any:
        """Drops slot i (its actor dead with its node, `rollout.elastic`); later slots move down one.
        Returns the slot's home."""
        import ray

        if self.sync is None or self.trainer is None:
            raise RuntimeError("open_weight_sync before a worker can be removed")
        if len(self.workers) == 1:
            raise ValueError("the last rollout worker is replaced, never removed")
        try:
            ray.kill(self.workers[i])
        except Exception:  # already gone
            pass
        missed = self._settle_pushes() if self.transport != "object_store" else set()
        home = self.homes.pop(i)
        del self.workers[i], self.deaths_in_a_row[i]
        if self.transport == "object_store":
            self.sync.remove_receiver(i)
        else:
            self._reopen()
        self._load_current_weights({j - (j > i) for j in missed if j != i})
        return home

    def _settle_pushes(self) -> set[int]:
        """Waits (up to the transport's timeout) for the pushes in flight before the transport closes,
        so no live worker is still reading it; returns the slots of live workers that failed one
        (a broadcast with a dead member fails for all): they load the current weights directly."""
        import ray
        from ray.exceptions import RayActorError

        assert self.sync is not None
        deadline = time.monotonic() + self.sync.plan.timeout_s
        missed: set[int] = set()
        for push in self.pushes:
            ray.wait(push.refs, num_returns=len(push.refs), timeout=max(0.0, deadline - time.monotonic()))
            for j, ref in enumerate(push.loads):
                try:
                    ray.get(ref, timeout=0)
                except RayActorError:
                    pass  # the dead one (its replacement loads the current weights)
                except Exception:
                    missed.add(j)
        self.pushes.clear()
        return missed
