"""Validation of the reward settings (`reward_weights`, `scoring.health`, DAPO's `rollout` fields): each
bad value fails in `validate`, naming the field, before any actor starts."""

from __future__ import annotations

import pytest

from titanrl.config import apply_overrides, validate
from titanrl.rewards import exact_match

from support.config_cases import checkpoint_dir, fails_validation, good_config  # noqa: F401  (fixtures)


def test_reward_settings_validate_and_parse(good_config):
    good_config.rewards = [good_config.rewards[0], exact_match]
    good_config.reward_weights = [0.5, 2.0]
    good_config.scoring.health.agreement_pairs = ["length_reward:exact_match"]
    good_config.rollout.shaping.dynamic_sampling = True
    good_config.rollout.shaping.overlong_filter = True
    good_config.rollout.shaping.overlong_buffer = 8
    validate(good_config)
    parsed = apply_overrides(
        good_config,
        [
            "reward_weights=1,0.25",
            "scoring.health.agreement_pairs=a:b,c:d",
            "rollout.shaping.overlong_buffer=4",
            "rollout.shaping.dynamic_sampling=true",
        ],
    )
    assert parsed.reward_weights == [1.0, 0.25] and parsed.scoring.health.agreement_pairs == ["a:b", "c:d"]
    assert parsed.rollout.shaping.overlong_buffer == 4 and parsed.rollout.shaping.dynamic_sampling is True


@pytest.mark.parametrize("change,needles", [
    (dict(reward_weights=[1.0, 2.0]), ("reward_weights has 2 entries but rewards has 1",)),
    (dict(reward_weights=[float("inf")]), ("reward_weights[0] must be a finite number",)),
    (dict(pairs=["length_reward"]), ("scoring.health.agreement_pairs", "is not 'reward_a:reward_b'")),
    (dict(pairs=["length_reward:nope"]), ("names 'nope'", "['length_reward']")),
    (dict(hacking_window=0), ("scoring.health.hacking_window must be >= 1",)),
    (dict(continuous=True, dynamic_sampling=True), ("rollout.shaping.dynamic_sampling works with lock-step",)),
    (dict(dynamic_sampling_max_requests=0), ("rollout.shaping.dynamic_sampling_max_requests must be >= 1",)),
    (dict(overlong_buffer=33), ("rollout.shaping.overlong_buffer must be in [0, rollout.sampling.max_new_tokens=32]",)),
    (dict(overlong_penalty=-1.0), ("rollout.shaping.overlong_penalty must be a finite number >= 0",)),
])
def test_bad_reward_settings_fail_naming_the_field(good_config, change, needles):
    change = dict(change)
    if "reward_weights" in change:
        good_config.reward_weights = change.pop("reward_weights")
    if "pairs" in change:
        good_config.scoring.health.agreement_pairs = change.pop("pairs")
    if "hacking_window" in change:
        good_config.scoring.health.hacking_window = change.pop("hacking_window")
    for name, value in change.items():
        setattr(good_config.rollout if name == "continuous" else good_config.rollout.shaping, name, value)
    fails_validation(good_config, *needles)


def test_overlong_penalty_names_itself_for_agreement_pairs(good_config):
    """The penalty is a reward term ('overlong_penalty') once overlong_buffer > 0, and only then."""
    good_config.scoring.health.agreement_pairs = ["length_reward:overlong_penalty"]
    fails_validation(good_config, "names 'overlong_penalty'")
    good_config.rollout.shaping.overlong_buffer = 4
    validate(good_config)
