"""The session's shared gloo world (tests/gloo_world.py): jobs do not see each other's changes,
and a failing or dying rank fails its job with the reason while the next job gets a fresh world."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _change_process_state(rank: int, world_size: int) -> None:
    """Everything a careless job could leave behind for the next one."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    os.environ["GLOO_WORLD_TEST_LEAK"] = "1"
    dist.new_group(list(range(world_size)))
    torch.rand(5)  # moves the global RNG on


def _process_state(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed import distributed_c10d as c10d

    return {"dtype": torch.get_default_dtype(), "threads": torch.get_num_threads(), "groups": len(c10d._world.pg_map),
            "env": os.environ.get("GLOO_WORLD_TEST_LEAK"), "draw": torch.rand(5)}


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits for rank 1 forever: only stopping the world ends it


def _rank_0_dies(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_jobs_start_from_the_fresh_world_state(gloo_world):
    """A job that changes the default dtype, threads, environment, process groups and RNG leaves
    the next job the state of the job before it: the same draws from the unseeded global RNG."""
    before = gloo_world.run(_process_state)
    gloo_world.run(_change_process_state)
    after = gloo_world.run(_process_state)
    for rank in range(gloo_world.world_size):
        draw_before, draw_after = before[rank].pop("draw"), after[rank].pop("draw")
        assert torch.equal(draw_after, draw_before), rank
        assert after[rank] == before[rank] == {"dtype": torch.float32, "threads": 1, "groups": 1, "env": None}


def test_failures_name_the_rank_and_the_next_job_gets_a_fresh_world(gloo_world):
    """A rank's exception fails the job with its traceback; a rank that dies fails it too (the
    peer stuck in a collective does not hang the test); each next job runs in new processes."""
    pids = gloo_world.run(_pid)
    with pytest.raises(RuntimeError, match=r"(?s)_raise_on_rank_1: rank 1 of 2 failed.*ValueError: rank 1 refuses"):
        gloo_world.run(_raise_on_rank_1, timeout_s=120)
    restarted = gloo_world.run(_pid)
    assert set(restarted).isdisjoint(pids)
    with pytest.raises(RuntimeError, match=r"(?s)_rank_0_dies: .*\[0\].*died"):
        gloo_world.run(_rank_0_dies, timeout_s=120)
    assert set(gloo_world.run(_pid)).isdisjoint(restarted)
