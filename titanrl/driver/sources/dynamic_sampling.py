"""DAPO's dynamic sampling (`rollout.shaping.dynamic_sampling`): a step trains on groups that carry a signal.

A group whose rewards are all equal (`titanrl.rewards.health.rewards_all_equal`) has zero GRPO
advantage for every sample, so it only dilutes the batch. `informative_groups` keeps a step's
other groups and asks for extra requests of fresh prompts (`more`, one request of
rollout.prompts_per_step prompts each, as DAPO over-samples) until the step has `target`
groups with unequal rewards, or `max_requests` extra requests were made; then the dropped groups
fill the remaining places (originals first), so every step trains on `target` groups. Surplus
groups of the last extra request are discarded, as in DAPO.

Metrics: `rollout/dynamic_sampling/replaced` (groups of the step that came from extra requests,
each in place of a dropped one), `rollout/dynamic_sampling/extra_requests`, and
`rollout/dynamic_sampling/unfilled` (places still held by all-equal groups after the bound).
"""

from __future__ import annotations

from collections.abc import Callable

from titanrl.rewards.health import rewards_all_equal
from titanrl.types import Group

REPLACED = "rollout/dynamic_sampling/replaced"
EXTRA_REQUESTS = "rollout/dynamic_sampling/extra_requests"
UNFILLED = "rollout/dynamic_sampling/unfilled"


def informative_groups(groups: list[Group], more: Callable[[], list[Group]],
                       max_requests: int) -> tuple[list[Group], dict[str, float]]:
    """The step's `len(groups)` groups, all-equal ones replaced where `more` can (see the module
    docstring), in group-id order, and the metrics."""
    target = len(groups)
    kept = [g for g in groups if not rewards_all_equal(g.rewards)]
    dropped = [g for g in groups if rewards_all_equal(g.rewards)]
    original = len(kept)
    requests = 0
    while len(kept) < target and requests < max_requests:
        requests += 1
        for group in more():
            (dropped if rewards_all_equal(group.rewards) else kept).append(group)
    kept = kept[:target]
    replaced = len(kept) - original
    unfilled = target - len(kept)
    chosen = kept + dropped[:unfilled]
    chosen.sort(key=lambda g: g.samples[0].group_id)
    return chosen, {REPLACED: float(replaced), EXTRA_REQUESTS: float(requests), UNFILLED: float(unfilled)}
