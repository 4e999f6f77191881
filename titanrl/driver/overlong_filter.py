"""DAPO's overlong filtering (`rollout.shaping.overlong_filter`): truncated samples are not trained on.

A sample that hit the token limit (`Sample.finished` False: single-turn, rollout.sampling.max_new_tokens;
an episode, its budget) has a reward that judges a cut-off answer; DAPO masks its loss instead of
teaching the model that length is punished. It stays in its group, so the group's baseline and
the other samples' advantages are as without the filter. Metric: `rollout/overlong_filtered`,
the number of samples masked in the step.
"""

from __future__ import annotations

import dataclasses

from titanrl.types import Group

OVERLONG_FILTERED = "rollout/overlong_filtered"


def filter_overlong(groups: list[Group]) -> tuple[list[Group], int]:
    """`groups` with every unfinished sample's loss mask zeroed (copies; the inputs are unchanged),
    and how many samples that was."""
    masked = 0
    out: list[Group] = []
    for group in groups:
        samples = []
        for s in group.samples:
            if not s.finished:
                s = dataclasses.replace(s, loss_mask=[0] * len(s.completion_ids))
                masked += 1
            samples.append(s)
        out.append(Group(samples))
    return out, masked
