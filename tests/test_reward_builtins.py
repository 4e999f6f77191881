"""The built-in rewards (`titanrl.rewards`) against values computed by hand, and DAPO's soft overlong shape."""

from __future__ import annotations

import pytest

import titanrl
from titanrl.rewards import ExactMatch, LengthPenalty, RegexReward, exact_match, linear_overlong_penalty
from titanrl.rewards.named import reward_names


def test_exact_match_compares_stripped_text_with_the_field():
    """1.0 only for the reference answer (surrounding whitespace ignored, case kept unless asked);
    the reference is compared as text; a row without the field is an error, not a silent 0."""
    assert exact_match("1+2=", " 3\n", answer="3") == 1.0
    assert exact_match("1+2=", "3.0", answer="3") == 0.0
    assert exact_match("1+2=", "3", answer=3) == 1.0  # str(reference)
    assert exact_match("q", "Paris", answer="paris") == 0.0
    assert ExactMatch(ignore_case=True)("q", "Paris", answer="paris") == 1.0
    assert ExactMatch("label", strip=False)("q", " x", label="x") == 0.0
    with pytest.raises(KeyError, match="'answer'"):
        exact_match("q", "3", label="3")


def test_regex_format_and_extract_and_compare():
    """A format reward gives `value` when the pattern matches in its mode; with `field`, group 1
    must equal the row's reference."""
    fmt = RegexReward(r"<answer>.*</answer>", match="fullmatch", value=0.5)
    assert fmt("q", "  <answer>7</answer>\n") == 0.5
    assert fmt("q", "so <answer>7</answer>") == 0.0  # fullmatch: extra text before
    assert RegexReward(r"<answer>")("q", "so <answer>7</answer>") == 1.0  # search
    assert RegexReward(r"<answer>", match="match")("q", "so <answer>") == 0.0
    answer = RegexReward(r"answer:\s*(-?\d+)", field="answer", name="answer")
    assert answer("q", "I think answer: 42.", answer="42") == 1.0
    assert answer("q", "I think answer: 41.", answer="42") == 0.0
    assert answer("q", "no idea", answer="42") == 0.0
    with pytest.raises(ValueError, match="match must be"):
        RegexReward("x", match="findall")  # type: ignore[arg-type]


@pytest.mark.parametrize("length,expected", [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (10, -1.0), (11, -1.0)])
def test_linear_overlong_penalty_is_dapos_shape(length, expected):
    """max_length 10, buffer 4: 0 up to 6, then (6 - L) / 4 down to -1 at 10, -1 beyond."""
    assert linear_overlong_penalty(length, 10, 4) == expected


def test_length_penalty_reward_scales_the_shape_on_its_length():
    """LengthPenalty(10, 4, scale=2): characters by default, any counter when given."""
    penalty = LengthPenalty(10, 4, scale=2.0)
    assert penalty("q", "x" * 5) == 0.0 and penalty("q", "x" * 8) == -1.0 and penalty("q", "x" * 12) == -2.0
    words = LengthPenalty(3, 2, length=lambda text: len(text.split()))
    assert words("q", "a b c") == -1.0 and words("q", "a b") == -0.5
    with pytest.raises(ValueError, match="buffer"):
        LengthPenalty(3, 0)


def test_reward_names_are_unique_and_built_ins_carry_theirs():
    """Metric names: __name__, a partial's function, a callable object's class, `lambda`; repeats get _2, _3."""
    import functools

    def score(prompt, completion, **f):
        return 0.0

    class Judge:
        def __call__(self, prompt, completion, **f):
            return 0.0

    names = reward_names([score, functools.partial(score), Judge(), lambda p, c, **f: 0.0, exact_match,
                          RegexReward("x"), LengthPenalty(4, 2), score])
    assert names == ["score", "score_2", "Judge", "lambda", "exact_match", "format", "length_penalty", "score_3"]
    assert titanrl.batched_reward is titanrl.rewards.batched_reward
