"""The embedded-default task: add two numbers of up to three digits.

A prompt is `"123+456="` and a correct completion is `"579"` followed by end-of-text.
The reward is exact match of the completion with the sum. Everything here is pure Python
with seeded RNGs, so the data files, the warm start and the reward are reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

MAX_DIGITS = 3
"""Operands are uniform in [0, 10**MAX_DIGITS - 1]."""
MAX_NEW_TOKENS = 6
"""A 4-digit sum plus end-of-text, with one token to spare (the byte tokenizer: 1 token per digit)."""
EVAL_SIZE = 200
"""Held-out problems for eval accuracy."""
DEV_SIZE = 200
"""Problems the warm-start script uses to decide when to stop (disjoint from eval)."""

MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=64,
    rope_theta=10_000.0,
)
"""A 0.5M-parameter Qwen3: small enough for 2 CPU cores, big enough to learn 3-digit addition."""


def format_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def row(a: int, b: int) -> dict[str, str]:
    """One dataset row: the prompt and the reference answer the reward compares with."""
    return {"prompt": format_prompt(a, b), "answer": str(a + b)}


def reward(prompt: str, completion: str, answer: str, **fields) -> float:
    """1.0 when the completion (up to end-of-text, whitespace stripped) is the exact sum, else 0.0."""
    return 1.0 if completion.strip() == answer else 0.0


def _pairs(seed: int) -> Iterator[tuple[int, int]]:
    rng = random.Random(seed)
    hi = 10**MAX_DIGITS - 1
    while True:
        yield rng.randint(0, hi), rng.randint(0, hi)


def _unique(seed: int, n: int, exclude: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for pair in _pairs(seed):
        if pair not in exclude:
            exclude.add(pair)
            out.append(pair)
            if len(out) == n:
                return out
    raise AssertionError("unreachable")


_EVAL_PAIRS = _unique(1234, EVAL_SIZE, set())
_DEV_PAIRS = _unique(4321, DEV_SIZE, set(_EVAL_PAIRS))
_HELD_OUT = set(_EVAL_PAIRS) | set(_DEV_PAIRS)


def eval_rows() -> list[dict[str, str]]:
    """The fixed held-out eval set (never trained on)."""
    return [row(a, b) for a, b in _EVAL_PAIRS]


def dev_rows() -> list[dict[str, str]]:
    """A second held-out set, used only to pick the warm start's stopping step."""
    return [row(a, b) for a, b in _DEV_PAIRS]


def train_rows(seed: int) -> Iterator[dict[str, str]]:
    """An endless stream of training problems, excluding every held-out pair."""
    for a, b in _pairs(seed):
        if (a, b) not in _HELD_OUT:
            yield row(a, b)
