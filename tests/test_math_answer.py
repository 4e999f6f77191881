"""The math-verify reward against cases worked out by hand: equal values in other notations
score 1, different values 0, the final answer is the one after GSM8K's `####`, and the reward
runs in a helper thread (where math-verify's signal-based timeouts would fail)."""

from __future__ import annotations

import threading

import pytest

from titanrl.rewards import math_answer
from titanrl.rewards.math_answer import final_answer

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("reference, completion", [
    (GSM8K_ANSWER, "She sold 72 clips altogether.\n#### 72"),       # GSM8K's own format
    (GSM8K_ANSWER, "48 + 24 = 72, so the answer is $\\boxed{72}$"),  # boxed, other numbers before it
    ("#### 1/2", "#### 0.5"),                                       # fraction = decimal
    ("#### 1/2", "#### \\frac{2}{4}"),                              # unreduced LaTeX fraction
    ("#### 0.75", "The share is $\\dfrac{3}{4}$."),                  # \dfrac in inline math
    ("#### 1234", "#### 1,234"),                                    # thousands separator
    ("#### 2\\sqrt{2}", "#### \\sqrt{8}"),                           # surds simplify: sqrt(8) = 2 sqrt(2)
    (5, "#### 5"),                                                  # a numeric answer field (CSV, Parquet)
])
def test_equivalent_answers_score_one(reference, completion):
    assert math_answer("q", completion, answer=reference) == 1.0


@pytest.mark.parametrize("reference, completion", [
    (GSM8K_ANSWER, "#### 73"),                       # off by one
    (GSM8K_ANSWER, "72 is wrong; #### 24"),          # the final answer counts, not an earlier number
    ("#### 1/2", "#### \\frac{1}{3}"),
    ("#### 0.75", "#### 3/5"),
    (GSM8K_ANSWER, "I do not know."),                # no answer at all
    (GSM8K_ANSWER, ""),
])
def test_wrong_or_missing_answers_score_zero(reference, completion):
    assert math_answer("q", completion, answer=reference) == 0.0


def test_final_answer_is_after_the_last_marker():
    assert final_answer("a #### 3\n#### 4 ") == "4"
    assert final_answer("no marker 7") == "no marker 7"


def test_a_row_without_answer_raises_and_helper_threads_work():
    """A missing reference is a dataset error; scoring in a non-main thread (as the worker's
    reward threads do) works because math-verify's signal timeouts are off."""
    with pytest.raises(ValueError, match="'answer' field"):
        math_answer("q", "#### 1")
    out = []
    thread = threading.Thread(target=lambda: out.append(math_answer("q", "#### \\frac{6}{4}", answer="#### 1.5")))
    thread.start()
    thread.join()
    assert out == [1.0]
