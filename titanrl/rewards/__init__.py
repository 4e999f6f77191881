"""Reusable reward functions, and how rewards are marked batched (`batched_reward`)."""

from titanrl.rewards.batched import batched_reward
from titanrl.rewards.code_tests import fraction_of_tests_passed
from titanrl.rewards.exact_match import ExactMatch, exact_match
from titanrl.rewards.length import LengthPenalty, linear_overlong_penalty
from titanrl.rewards.math_answer import math_answer
from titanrl.rewards.reasoning_gym import (ReasoningGymAnswer, reasoning_gym_answer, reasoning_gym_format,
                                          reasoning_gym_score)
from titanrl.rewards.regex import RegexReward

__all__ = [
    "ExactMatch", "LengthPenalty", "ReasoningGymAnswer", "RegexReward", "batched_reward", "exact_match",
    "fraction_of_tests_passed", "linear_overlong_penalty", "math_answer", "reasoning_gym_answer",
    "reasoning_gym_format", "reasoning_gym_score",
]
