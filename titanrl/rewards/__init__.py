"""Reusable reward functions."""

from titanrl.rewards.code_tests import fraction_of_tests_passed

__all__ = ["fraction_of_tests_passed"]
