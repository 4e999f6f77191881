"""A broadcast push that loses a member mid-stream fails on every other member within seconds, not
after the group's `timeout_s` (the 300 s a surviving rollout worker and the trainer waited when a
rollout worker's node was lost during a push).

The three members are threads of this process, each with a gloo group of its own (its own
connections, as the trainer's and the workers' processes have). The lost member joins the push
and then either stops answering with its connections open (a stopped process, a machine gone
without closing them: gloo's peers never notice) or gives up with an error of its own (its peers
are not told: only its leaving the group tells them).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from titanrl.weight_sync.broadcast import BroadcastGroup, BroadcastSender, receive_broadcast
from titanrl.weight_sync.layout import WeightSyncError
from titanrl.weight_sync.plan import make_plan
from titanrl.weight_sync.source import TensorsWeights
from titanrl.weight_sync.target import ParameterTarget

TIMEOUT_S = 60.0
"""The group's timeout: a member that waits it out fails the test."""
BIG = 8 << 20
"""Elements of the large tensor (32 MiB): more than loopback's socket buffers take in, so a sender
blocks on a member that does not read."""


def _model() -> nn.Module:
    model = nn.Module()
    model.big, model.small = nn.Parameter(torch.zeros(BIG)), nn.Parameter(torch.zeros(16))
    return model


def _push(plan, live_worker_role, third_role) -> dict:
    """Trainer (rank 0) pushes version 1; ranks 1 and 2 play the given roles. Returns, per member
    that ran a push, (seconds from its start to its end, its result or error)."""
    weights = TensorsWeights({"big": torch.ones(BIG), "small": torch.ones(16)})
    announced, finished = threading.Event(), threading.Event()
    seen: dict = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            seen[name] = (time.perf_counter() - t0, fn())
        except Exception as e:  # noqa: BLE001 - the error is the result
            seen[name] = (time.perf_counter() - t0, e)

    def trainer() -> None:
        sender = BroadcastSender(plan)
        try:
            seen["announcement"] = sender.publish(1, weights)
            announced.set()
            timed("trainer", lambda: sender.send(1, weights))
            seen["trainer_left"] = sender.group.pg is None
        finally:
            announced.set()
            sender.close()

    def member(rank: int, role: str) -> None:
        group = BroadcastGroup(plan, rank)
        try:
            announced.wait(TIMEOUT_S)
            if role == "receives":
                timed("worker", lambda: receive_broadcast(group, ParameterTarget(_model()), seen["announcement"], 1))
            elif role == "goes_silent_in_the_push":
                group.max_over_members(0)  # in the push...
                finished.wait(TIMEOUT_S)  # ...and silent, its connections open
            elif role == "never_joins":  # silent from the start, its connections open
                finished.wait(TIMEOUT_S)
            elif role == "fails":
                with group.failing_together(1):
                    raise RuntimeError("this member's own failure")
        except RuntimeError:
            pass
        finally:
            if role != "receives":
                finished.wait(TIMEOUT_S)  # its connections stay open until the others are done
            group.close()

    threads = [threading.Thread(target=trainer), threading.Thread(target=member, args=(1, live_worker_role)),
               threading.Thread(target=member, args=(2, third_role))]
    for t in threads:
        t.start()
    threads[0].join(TIMEOUT_S + 30)
    if live_worker_role == "receives":
        threads[1].join(TIMEOUT_S + 30)
    finished.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return seen


def _assert_left_its_group(error: BaseException) -> None:
    assert isinstance(error, RuntimeError), error
    assert "left its group" in error.__notes__[0] and "stream_timeout_s" in error.__notes__[0], error.__notes__


def test_a_member_silent_mid_push_ends_the_push_within_the_stream_timeout():
    """A worker goes silent once in the push (a stopped process, a machine gone without closing
    its connections: gloo's peers never notice): the broadcasts' own timeout (stream_timeout_s=3)
    ends the push, whoever times out leaves the group, and the live worker is not left waiting
    either: it fails on the closed connections, or (gloo sent to it before the silent one) already
    holds every tensor. Nobody waits for the group's timeout (60 s here)."""
    plan = make_plan("broadcast", 2, timeout_s=TIMEOUT_S, stream_timeout_s=3.0)
    seen = _push(plan, "receives", "goes_silent_in_the_push")
    for member in ("trainer", "worker"):
        assert seen[member][0] < 3.0 + 10.0, (member, seen[member])
    _assert_left_its_group(seen["trainer"][1])
    assert seen["trainer_left"]  # a group whose push failed is left for good: the run opens a new one
    worker = seen["worker"][1]
    if worker != 2:
        _assert_left_its_group(worker)


def test_a_member_that_fails_leaves_its_group_so_no_peer_waits_on_it():
    """The lost rollout node's case: one worker is gone without its connections closing (gloo's
    peers never notice), the other notices and fails. Its failure makes it leave the group, so
    the trainer, waiting in the push's first exchange (whose timeout is the group's 60 s), fails
    at once instead of waiting for either of them."""
    plan = make_plan("broadcast", 2, timeout_s=TIMEOUT_S)
    seen = _push(plan, "fails", "never_joins")
    assert seen["trainer"][0] < 10.0, seen["trainer"]
    assert isinstance(seen["trainer"][1], RuntimeError), seen["trainer"]
    assert seen["trainer_left"]


def test_a_left_group_refuses_the_next_push():
    """After leaving (a failed push), the group names what to do instead of hanging on dead connections."""
    plan = make_plan("broadcast", 1, timeout_s=TIMEOUT_S)
    sender_box: dict = {}
    opener = threading.Thread(target=lambda: sender_box.setdefault("group", BroadcastGroup(plan, 0)))
    opener.start()
    group = BroadcastGroup(plan, 1)
    opener.join(TIMEOUT_S)
    with pytest.raises(RuntimeError, match="boom"), group.failing_together(3):
        raise RuntimeError("boom")
    with pytest.raises(WeightSyncError, match="left after a failed push"):
        group.max_over_members(0)
    group.close()
    sender_box["group"].close()
