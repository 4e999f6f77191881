"""Runs a function in a local torch.distributed world of N processes (gloo, 127.0.0.1).

For tests, benchmarks and single-machine checks; the trainer proper runs as Ray actors.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, threads: int, queue, args: tuple,
           stack_dump_s: float) -> None:
    # A hung collective shows as every rank's stack on stderr shortly before the parent gives up.
    faulthandler.dump_traceback_later(stack_dump_s, exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle bytes: torch's multiprocessing pickler would pass tensors through shared
        # memory that vanishes when this process exits.
        queue.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        ok = True
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        ok = False
    # Deliver the result before anything that could block (peers may be stuck in a collective).
    queue.close()
    queue.join_thread()
    faulthandler.cancel_dump_traceback_later()
    if ok:
        dist.destroy_process_group()
    else:
        os._exit(1)


def run_local_world(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
                    timeout_s: float = 600.0) -> list[Any]:
    """Calls fn(rank, world_size, *args) in `world_size` spawned processes; returns their results by rank.

    `fn` must be importable (module level). If a rank raises, the others are stopped and a
    RuntimeError carries the failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, threads, queue, args, timeout_s * 0.75),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=timeout_s)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                raise RuntimeError(f"no result within {timeout_s} s; ranks exited without one: {dead}") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
