"""Reusable reward functions."""

from titanrl.rewards.code_tests import fraction_of_tests_passed
from titanrl.rewards.math_answer import math_answer as math_answer  # noqa: F401 - re-exported

__all__ = ["fraction_of_tests_passed"]
