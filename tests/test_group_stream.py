"""`GroupStream.generate_groups`: one call for many groups, each handed back as soon as it finishes.

The groups are stand-ins that finish when the test says so (one asyncio.Event each), so the order
is the test's, not the machine's; no Ray, no engine (the streaming call itself is exercised through
real Ray by tests/test_buffer.py and tests/test_continuous_runs.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from titanrl.rollout.group_stream import GroupStream
from titanrl.types import Group, Sample


class EventGroups(GroupStream):
    """Group g finishes once `release(g)` is called; `fail` names a group that raises instead."""

    def __init__(self, fail: int | None = None) -> None:
        self.events: dict[int, asyncio.Event] = {}
        self.cancelled: list[int] = []
        self.fail = fail

    def release(self, group_id: int) -> None:
        self.events.setdefault(group_id, asyncio.Event()).set()

    async def generate_group(self, row: dict[str, Any], seed: int, group_id: int, min_version: int) -> Group:
        try:
            await self.events.setdefault(group_id, asyncio.Event()).wait()
        except asyncio.CancelledError:
            self.cancelled.append(group_id)
            raise
        if group_id == self.fail:
            raise ValueError(f"group {group_id} failed")
        return Group([Sample(prompt=row["prompt"], completion="c", prompt_ids=[1], completion_ids=[2],
                             gen_logprobs=[0.0], reward=0.0, group_id=group_id, policy_version=min_version,
                             fields={"seed": seed})])


async def _next_item(stream: Any) -> list[tuple[int, Group]]:
    """The stream's next item if it is there within a few event-loop turns (counted, not timed)."""
    item = asyncio.ensure_future(anext(stream))
    for _ in range(50):
        if item.done():
            return item.result()
        await asyncio.sleep(0)
    item.cancel()
    raise AssertionError("the stream held a finished group back")


def _requests(group_ids: list[int]) -> list[tuple[dict[str, Any], int, int, int]]:
    return [({"prompt": f"p{g}"}, 100 + g, g, 3) for g in group_ids]


def test_groups_come_back_as_they_finish_not_when_the_call_does():
    """A group that finishes first is yielded while the others still run; groups finished together
    come in one item; every group comes back once, with its own request's arguments."""
    async def main() -> list[list[tuple[int, Group]]]:
        worker = EventGroups()
        stream = worker.generate_groups(_requests([0, 1, 2, 3]))
        items = []
        worker.release(2)
        items.append(await _next_item(stream))
        worker.release(0)
        worker.release(3)
        await asyncio.sleep(0)  # both finish before the stream looks again
        items.append(await _next_item(stream))
        worker.release(1)
        items += [item async for item in stream]
        return items

    items = asyncio.run(main())
    assert [[gid for gid, _ in item] for item in items] == [[2], [0, 3], [1]]
    for item in items:
        for gid, group in item:
            (sample,) = group.samples
            assert (sample.group_id, sample.prompt, sample.fields["seed"]) == (gid, f"p{gid}", 100 + gid)
            assert sample.policy_version == 3


def test_a_failed_group_fails_the_stream_and_stops_the_rest():
    """A group that raises ends the stream with its error; the groups still running are cancelled
    (a driver that sees the error does not leave work running in the engine)."""
    async def main() -> list[int]:
        worker = EventGroups(fail=1)
        stream = worker.generate_groups(_requests([0, 1, 2]))
        worker.release(1)
        with pytest.raises(ValueError, match="group 1 failed"):
            await anext(stream)
        await asyncio.sleep(0)
        return sorted(worker.cancelled)  # now: asyncio.run cancels leftover tasks itself on the way out

    assert asyncio.run(main()) == [0, 2]


def test_closing_the_stream_cancels_the_groups_still_running():
    """A caller that goes away (Ray cancels the call, the driver drops it) stops what it asked for."""
    async def main() -> list[int]:
        worker = EventGroups()
        stream = worker.generate_groups(_requests([0, 1, 2]))
        worker.release(0)
        assert [gid for gid, _ in await _next_item(stream)] == [0]
        await stream.aclose()
        await asyncio.sleep(0)
        return sorted(worker.cancelled)

    assert asyncio.run(main()) == [1, 2]
