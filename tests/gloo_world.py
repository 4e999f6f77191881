"""One persistent local gloo world that many test files submit jobs to.

Starting a world (spawning processes, importing torch, joining gloo) costs ~10 s, so the
session keeps one 2-rank world alive (the `gloo_world` fixture in conftest.py) and runs each
file's world function in it, in turn, as `run_local_world` would in a fresh world.

A job is `(module, function name, args)`; every rank calls `fn(rank, world_size, *args)` and
the results come back by rank. Each job starts from the state a fresh world has (RNG states,
default dtype, threads, environment) and leaves no process groups behind. If a rank raises,
dies or misses the timeout, the world is stopped, the job's caller gets a RuntimeError (with
the remote traceback when there is one) and the next job starts a fresh world.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from titanrl.trainer.parallel.launch import free_port
from world_job_state import FreshState

POLL_S = 1.0
"""How often the parent checks for dead ranks while it waits for a result."""


class GlooWorld:
    """A lazily started world of `world_size` gloo processes that runs submitted jobs in order."""

    def __init__(self, world_size: int = 2, threads: int = 1) -> None:
        self.world_size = world_size
        self.threads = threads
        self._procs: list[Any] = []
        self._jobs: list[Any] = []  # one queue per rank, so each rank gets every job exactly once
        self._results: Any = None
        self._next_id = 0

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0) -> list[Any]:
        """Calls fn(rank, world_size, *args) on every rank; returns the results by rank.

        `fn` must be a module-level function (it is sent by module and name). Raises
        RuntimeError, after stopping the world, if a rank fails, dies or runs past timeout_s.
        """
        module, name = fn.__module__, fn.__qualname__
        if "." in name or "<" in name:
            raise ValueError(f"{module}.{name} is not a module-level function")
        if not self._alive():
            self._start()
        job_id, self._next_id = self._next_id, self._next_id + 1
        payload = pickle.dumps((module, name, args, timeout_s))
        for q in self._jobs:
            q.put((job_id, payload))
        try:
            return self._collect(job_id, f"{module}.{name}", timeout_s)
        except BaseException:
            self.close(kill=True)  # peers may sit in a collective forever: the next job gets a fresh world
            raise

    def close(self, kill: bool = False) -> None:
        """Stops the world: asks idle ranks to leave (up to 10 s in all), or kills them at once."""
        if not self._procs:
            return
        if not kill:
            for q in self._jobs:
                with contextlib.suppress(Exception):
                    q.put(None)
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._jobs, self._results = [], [], None

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        self.close()
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_serve, args=(r, self.world_size, port, self.threads, self._jobs[r],
                                                        self._results), daemon=True)
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def _collect(self, job_id: int, what: str, timeout_s: float) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size:
            try:
                got_id, rank, ok, value = self._results.get(timeout=POLL_S)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    raise RuntimeError(f"{what}: rank(s) {dead} of the shared gloo world died "
                                       f"(exit codes {codes}) without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: no result from rank(s) "
                                       f"{sorted(set(range(self.world_size)) - set(results))} within "
                                       f"{timeout_s} s (their stacks are on stderr)") from None
                continue
            if got_id != job_id:
                continue  # a straggler from an earlier job; cannot happen after a restart, but harmless
            if not ok:
                time.sleep(POLL_S)  # a peer whose death caused this error has exited by now
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r != rank]
                also = f" (rank(s) {dead} died too)" if dead else ""
                raise RuntimeError(f"{what}: rank {rank} of {self.world_size} failed{also}:\n{value}")
            results[rank] = pickle.loads(value)
        return [results[r] for r in range(self.world_size)]


def _serve(rank: int, world_size: int, port: int, threads: int, jobs: Any, results: Any) -> None:
    """A rank's loop: join the world once, then run jobs until the sentinel (or the parent's exit)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    fresh = FreshState.capture()
    while (job := _next_job(jobs)) is not None:
        job_id, payload = job
        try:
            module, name, args, timeout_s = pickle.loads(payload)
            # A hung collective shows as every rank's stack on stderr before the parent gives up.
            faulthandler.dump_traceback_later(timeout_s * 0.75, exit=False)
            with fresh.restored():
                fn = getattr(importlib.import_module(module), name)
                # Plain pickle bytes: torch's multiprocessing pickler would pass tensors through
                # shared memory, tying the result's lifetime to this process.
                value = pickle.dumps(fn(rank, world_size, *args))
            results.put((job_id, rank, True, value))
        except BaseException:
            results.put((job_id, rank, False, traceback.format_exc()))
            # Peers may be stuck in a collective with this rank: the parent stops the world.
            results.close()
            results.join_thread()
            os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


def _next_job(jobs: Any) -> tuple[int, bytes] | None:
    """The next (job id, payload), or None to stop: on the sentinel, or once the parent is gone
    (this process holds the queue's write end too, so it would never see end-of-file)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return jobs.get(timeout=POLL_S * 5)
        except queue_module.Empty:
            if parent is not None and not parent.is_alive():
                return None
