"""Many prompt groups in one Ray call, each handed back as soon as it finishes.

A continuous run admits a whole step's groups at once. One Ray call per group cost the driver a
task submission, a result object and a `ray.wait` wake-up per group (64 a step on the arithmetic
example), on the same two cores the trainer and the engine need. `GroupStream.generate_groups`
takes a worker's share of an admission in one call, as a Ray streaming generator
(`num_returns="streaming"`): every group runs concurrently in the worker's one continuous batch,
and each item the stream yields is every group that finished since the previous item, so a
group that finishes early is never held back by a slow one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from titanrl.types import Group

GroupRequest = tuple[dict[str, Any], int, int, int]
"""`(row, seed, group_id, min_version)`: the arguments of one `generate_group` call."""


class GroupStream:
    """Adds `generate_groups` to an async actor class that has `generate_group`."""

    async def generate_group(self, row: dict[str, Any], seed: int, group_id: int, min_version: int) -> Group:
        raise NotImplementedError

    async def generate_groups(self, requests: list[GroupRequest]) -> AsyncIterator[list[tuple[int, Group]]]:
        """Runs every request's `generate_group` at once; yields `(group_id, group)` pairs of the
        groups finished since the last item, until all have. A failed group fails the stream."""
        running = {asyncio.ensure_future(self.generate_group(*request)): request[2] for request in requests}
        try:
            while running:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                yield [(running.pop(task), task.result()) for task in sorted(done, key=running.__getitem__)]
        finally:  # the caller went away (or a group failed): stop generating the rest
            for task in running:
                task.cancel()
