"""Dynamic sampling through the real `LockstepRollouts` (real Ray, no vLLM): a step's all-equal groups
are replaced by groups of fresh prompts from extra requests, and the data stream stays in order.

The worker is a stand-in Ray actor honouring `RolloutWorker.generate` without an engine (as
test_buffer.py's stand-ins do for the continuous source): a row marked `equal` yields a group
whose two rewards are equal, any other row a group with rewards 0 and 1.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from titanrl.data import PromptStream
from titanrl.driver.sources.dynamic_sampling import EXTRA_REQUESTS, REPLACED, UNFILLED
from titanrl.driver.sources.lockstep import LockstepRollouts
from titanrl.rewards.health import rewards_all_equal
from titanrl.types import Group, RolloutBatch, Sample

ROWS = [{"prompt": f"row {i}", "equal": i % 3 != 0} for i in range(12)]
"""Rows 0, 3, 6, 9 give informative groups; the other 8 all-equal ones."""
PROMPTS_PER_STEP, SEED = 4, 3


class StandInWorker:
    """A lock-step `RolloutWorker` without an engine: group_size 2, rewards chosen by the row."""

    def generate(self, rows: list[dict[str, Any]], seed: int, first_group_id: int) -> RolloutBatch:
        groups = [
            Group([Sample(prompt=row["prompt"], completion="c", prompt_ids=[1], completion_ids=[2], gen_logprobs=[0.0],
                          reward=1.0 if row["equal"] else float(i), group_id=first_group_id + j, policy_version=0)
                   for i in range(2)])
            for j, row in enumerate(rows)
        ]
        return RolloutBatch(groups, gen_tokens=2 * len(rows), gen_seconds=0.5, policy_version=0)


@pytest.fixture(scope="module")
def worker_cls(ray_session):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    return ray_session.remote(StandInWorker)


def _source(worker_cls, max_requests: int) -> LockstepRollouts:
    return LockstepRollouts(lambda i: worker_cls.remote(), 1, PromptStream(ROWS, PROMPTS_PER_STEP, SEED), run_seed=0,
                            group_size=2, turns_per_sample=1, max_staleness=0, steps=2,
                            dynamic_sampling_max_requests=max_requests)


def _draws(n: int) -> list[list[str]]:
    """The prompts of the stream's first n batches (the same stream the source reads)."""
    stream = PromptStream(ROWS, PROMPTS_PER_STEP, SEED)
    return [[row["prompt"] for row in stream.next_batch()] for _ in range(n)]


def _informative(prompt: str) -> bool:
    return int(prompt.split()[1]) % 3 == 0


def test_lockstep_replaces_all_equal_groups_with_fresh_prompts(worker_cls):
    """Step 1 trains on 4 groups: the request's informative ones plus the first informative ones of
    extra requests, in draw order (group ids follow the draws); step 2's request draws after the
    extra requests. Switched off, step 1 trains on the request's groups as they are."""
    draws = _draws(6)
    flat = [p for batch in draws for p in batch]
    # Hand-derived expectation: walk the draws batch by batch until 4 informative prompts are found.
    wanted, batches_used = [], 0
    for batch in draws:
        if len(wanted) >= PROMPTS_PER_STEP:
            break
        batches_used += 1
        wanted += [p for p in batch if _informative(p)]
    assert batches_used > 1, "the seed must leave all-equal groups in the first batch"
    wanted = wanted[:PROMPTS_PER_STEP]

    source = _source(worker_cls, max_requests=4)
    source.fill(0, 0)
    rollouts = source.next_step(1)
    assert [g.samples[0].prompt for g in rollouts.groups] == wanted
    assert [g.samples[0].group_id for g in rollouts.groups] == [flat.index(p) for p in wanted]
    assert not any(rewards_all_equal(g.rewards) for g in rollouts.groups)
    first_informative = sum(map(_informative, draws[0]))
    assert rollouts.metrics[REPLACED] == PROMPTS_PER_STEP - first_informative
    assert rollouts.metrics[EXTRA_REQUESTS] == batches_used - 1 and rollouts.metrics[UNFILLED] == 0
    assert rollouts.gen_tokens == 2 * PROMPTS_PER_STEP * batches_used  # discarded groups were generated too
    assert rollouts.gen_seconds == 0.5 * batches_used
    source.trained(1)
    source.fill(1, 0)
    step2 = source.next_step(2)
    first = PROMPTS_PER_STEP * batches_used  # step 2's request: the next draw, the next group ids
    ids = {g.samples[0].prompt: g.samples[0].group_id for g in step2.groups}
    assert min(ids.values()) >= first
    assert {p: first + k for k, p in enumerate(draws[batches_used]) if _informative(p)}.items() <= ids.items()

    plain = _source(worker_cls, max_requests=0)
    plain.fill(0, 0)
    as_is = plain.next_step(1)
    assert [g.samples[0].prompt for g in as_is.groups] == draws[0]
    assert REPLACED not in as_is.metrics
