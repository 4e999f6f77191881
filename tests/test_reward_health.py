"""Per-reward metrics, reward health, and DAPO's sample side (overlong penalty and filter, dynamic
sampling's choice of groups), on hand-built groups with hand-computed answers."""

from __future__ import annotations

import logging

import pytest

from titanrl.driver.overlong_filter import filter_overlong
from titanrl.driver.sources.dynamic_sampling import EXTRA_REQUESTS, REPLACED, UNFILLED, informative_groups
from titanrl.rewards.health import RewardHackingWatch, agreement, reward_health, rewards_all_equal
from titanrl.rewards.metrics import reward_term_metrics
from titanrl.rollout.single_turn import OverlongPenalty, SingleTurn
from titanrl.rollout.vllm.engine import Completion
from titanrl.types import Group, RewardTerms, Sample


def _sample(reward: float, group_id: int = 0, values=None, seconds=None, failed=None, finished=True,
            tokens: int = 2) -> Sample:
    terms = RewardTerms(dict(values or {}), dict(seconds or {}), failed)
    return Sample(prompt="p", completion="c", prompt_ids=[1], completion_ids=[5] * tokens, gen_logprobs=[-0.5] * tokens,
                  reward=reward, group_id=group_id, policy_version=0, finished=finished, reward_terms=terms)


def _group(group_id: int, *rewards: float) -> Group:
    return Group([_sample(r, group_id) for r in rewards])


def test_per_reward_mean_errors_and_seconds():
    """Mean over the samples where a reward returned a value, errors where it failed, seconds summed."""
    groups = [Group([
        _sample(1.0, values={"fmt": 1.0, "acc": 1.0}, seconds={"fmt": 0.5, "acc": 1.0}),
        _sample(0.0, values={"fmt": 0.0}, seconds={"fmt": 0.25, "acc": 2.0}, failed="acc"),
    ]), Group([_sample(0.5, values={"fmt": 0.5, "acc": 0.0}, seconds={"fmt": 0.25, "acc": 1.0})])]
    assert reward_term_metrics(groups) == {
        "reward/fmt/mean": 0.5, "reward/fmt/errors": 0.0, "reward/fmt/seconds": 1.0,
        "reward/acc/mean": 0.5, "reward/acc/errors": 1.0, "reward/acc/seconds": 4.0,
    }


def test_zero_variance_groups_and_agreement():
    """2 of 4 groups all equal (one within the tolerance); 'fmt:acc' agree on 2 of the 3 samples scored by both."""
    groups = [_group(0, 1.0, 1.0), _group(1, 0.0, 1.0), _group(2, 0.3, 0.3 + 1e-9), _group(3, 0.0, 0.5)]
    assert reward_health(groups, [])["reward/zero_variance_groups"] == 0.5
    assert rewards_all_equal([2.0, 2.0]) and not rewards_all_equal([0.0, 1e-3])
    scored = [Group([_sample(0, values={"fmt": 1.0, "acc": 1.0}), _sample(0, values={"fmt": 0.0, "acc": 0.0}),
                     _sample(0, values={"fmt": 1.0, "acc": 0.0}), _sample(0, values={"fmt": 1.0})])]
    assert agreement(scored, ["fmt:acc"]) == {"reward/agreement/fmt_vs_acc": pytest.approx(2 / 3)}
    assert agreement(scored, ["fmt:other"]) == {}


def test_hacking_watch_flags_a_reward_rise_without_an_accuracy_rise(caplog):
    """Eval 0 (step 0) has no steps; eval 1 has nothing to compare with; at eval 2 'fmt' rose by 0.4
    (0.3 -> 0.7) while accuracy rose 0.01 < 0.02: flagged and warned once; 'acc' rose 0.1 < 0.2:
    not flagged; at eval 3 the flag stays on with no second warning; at eval 4 accuracy rose: off."""
    watch = RewardHackingWatch(window=1, reward_rise=0.2, accuracy_rise=0.02)
    assert watch.evaluation(0.10) == {}
    for fmt, acc in [(0.2, 0.1), (0.4, 0.1)]:
        watch.step({"fmt": fmt, "acc": acc})
    assert watch.evaluation(0.10) == {}
    for fmt, acc in [(0.6, 0.2), (0.8, 0.2)]:
        watch.step({"fmt": fmt, "acc": acc})
    with caplog.at_level(logging.WARNING, logger="titanrl"):
        assert watch.evaluation(0.11) == {"reward/fmt/hacking_suspected": 1.0, "reward/acc/hacking_suspected": 0.0}
        watch.step({"fmt": 1.0, "acc": 0.2})
        assert watch.evaluation(0.11)["reward/fmt/hacking_suspected"] == 1.0  # 1.0 - 0.7 >= 0.2
    warnings = [r.getMessage() for r in caplog.records if "reward hacking" in r.getMessage()]
    assert len(warnings) == 1 and "'fmt' rose by 0.400" in warnings[0]
    watch.step({"fmt": 1.3, "acc": 0.3})
    assert watch.evaluation(0.5)["reward/fmt/hacking_suspected"] == 0.0
    off = RewardHackingWatch(window=1, reward_rise=0.0, accuracy_rise=0.02)
    for acc in (0.0, 0.0, 0.0):
        off.step({"fmt": 10 * acc + len(off._evals)})
        assert off.evaluation(acc) == {}


def test_overlong_filter_zeroes_the_loss_mask_of_unfinished_samples_only():
    groups = [Group([_sample(1.0, finished=False, tokens=3), _sample(0.0)]), Group([_sample(0.5, 1, finished=False)])]
    out, masked = filter_overlong(groups)
    assert masked == 2
    assert [[s.loss_mask for s in g.samples] for g in out] == [[[0, 0, 0], None], [[0, 0]]]
    assert [s.reward for g in out for s in g.samples] == [1.0, 0.0, 0.5]  # rewards (the baseline) untouched
    assert groups[0].samples[0].loss_mask is None  # the inputs are not modified


def test_soft_overlong_penalty_is_added_to_training_rewards():
    """max_new_tokens 8, buffer 4, scale 0.5: 3 tokens -> 0, 6 -> 0.5 * (4 - 6) / 4 = -0.25, 8 -> -0.5;
    a failed reward keeps error_value; the penalty is a term of its own."""
    turn = SingleTurn("prompt", None, OverlongPenalty(max_tokens=8, buffer=4, scale=0.5))

    def completion(n: int) -> Completion:
        return Completion(prompt_token_ids=[1], token_ids=[3] * n, text="x" * n, logprobs=[-0.1] * n,
                          finish_reason="length" if n == 8 else "stop", policy_version=0,
                          token_versions=[0] * n)

    rows = [{"prompt": "q"}]
    outputs = [[completion(3), completion(6), completion(8), completion(8)]]
    scored = [(1.0, None, RewardTerms({"acc": 1.0})), (1.0, None, RewardTerms({"acc": 1.0})), (0.0, None),
              (-1.0, "reward acc raised")]
    (group,) = turn.groups(rows, outputs, scored, first_group_id=0)
    assert [s.reward for s in group.samples] == [1.0, 0.75, -0.5, -1.0]
    assert [s.reward_terms.values["overlong_penalty"] for s in group.samples] == [0.0, -0.25, -0.5, -0.5]
    assert group.samples[1].reward_terms.values["acc"] == 1.0


def test_informative_groups_replace_all_equal_groups_from_extra_requests():
    """Step of 4 groups, 2 all equal: the first extra request brings 1 informative group (and 3 all-equal
    ones), the second 2 more, of which 1 is surplus: 2 replaced, 2 extra requests, none unfilled, in group-id order."""
    step = [_group(0, 1, 1), _group(1, 0, 1), _group(2, 0, 0), _group(3, 1, 0)]
    extra = iter([[_group(4, 0, 0), _group(5, 0, 1), _group(6, 1, 1), _group(7, 0, 0)],
                  [_group(8, 1, 0), _group(9, 0, 1), _group(10, 1, 1), _group(11, 0, 0)]])
    chosen, metrics = informative_groups(step, lambda: next(extra), max_requests=4)
    assert [g.samples[0].group_id for g in chosen] == [1, 3, 5, 8]
    assert metrics == {REPLACED: 2.0, EXTRA_REQUESTS: 2.0, UNFILLED: 0.0}


def test_informative_groups_fill_back_with_all_equal_groups_at_the_bound():
    step = [_group(0, 1, 1), _group(1, 0, 1), _group(2, 0, 0)]
    chosen, metrics = informative_groups(step, lambda: [_group(3, 2, 2), _group(4, 1, 1), _group(5, 0, 0)],
                                         max_requests=1)
    assert [g.samples[0].group_id for g in chosen] == [0, 1, 2]  # the step's own all-equal groups first
    assert metrics == {REPLACED: 0.0, EXTRA_REQUESTS: 1.0, UNFILLED: 2.0}
    none_needed, metrics = informative_groups([_group(0, 0, 1)], lambda: pytest.fail("asked for more"), 3)
    assert metrics[EXTRA_REQUESTS] == 0.0 and len(none_needed) == 1
