"""The tool-agent task: arithmetic a small model cannot do in its head, but Python can.

Each row asks for the product of two 3-digit numbers, such as `347 * 829` (half the rows
have a 5-digit answer, half a 6-digit one). A 0.5M-parameter byte-level model does not learn
3-digit multiplication, but it can learn two copy skills: copy the expression into a
`python` tool call, and copy the printed result into its final answer. An episode that
does both earns 1; anything else (an answer without a call, a malformed call, a wrong
tool, a wrong number) earns 0. Everything here is pure Python with seeded RNGs, so the
data files and the warm start are reproducible.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

TEMPLATES = ("{a} * {b}",)
"""Expression shapes; every operand has exactly three digits. (`eval_expression` also reads
`a * b + c` and `a * b - c`; with those the tiny model takes far longer to learn to copy.)"""
EVAL_SIZE = 100
"""Held-out problems for eval/accuracy (greedy episodes)."""
DEV_SIZE = 200
"""Problems the warm-start script measures itself on (disjoint from eval)."""
MAX_TOKENS_PER_TURN = 96
"""A tool call is ~70 byte tokens; an answer is at most 7 (6 digits + end of turn)."""

MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=10_000.0,
)
"""The arithmetic example's 0.5M-parameter Qwen3, with room for a whole episode (~210 prompt + ~180 completion tokens)."""

TOOL_NAME = "python"
"""The one tool the model has: runs a program in the bubblewrap sandbox, returns its output."""
WRONG_TOOL_NAME = "calculator"
"""A tool that does not exist; some warm-start episodes call it and get an error back."""


def question(expression: str) -> str:
    """The user turn of a row."""
    return f"What is {expression}?"


def row(expression: str) -> dict[str, str]:
    """One dataset row: the question and the exact integer answer."""
    return {"prompt": question(expression), "expression": expression, "answer": str(eval_expression(expression))}


def eval_expression(expression: str) -> int:
    """The reference value, computed without eval(): `a * b [+|- c]`."""
    tokens = expression.split()
    value = int(tokens[0]) * int(tokens[2])
    if len(tokens) == 5:
        value = value + int(tokens[4]) if tokens[3] == "+" else value - int(tokens[4])
    return value


def tool_call(expression: str, name: str = TOOL_NAME) -> str:
    """The model turn that asks the tool for the value (stops at `</tool_call>`)."""
    arguments = {"code": f"print({expression})"} if name == TOOL_NAME else {"expression": expression}
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _expressions(seed: int) -> Iterator[str]:
    """Half the problems have a 5-digit answer, half a 6-digit one.

    Uniform operands give 5-digit products only ~10 % of the time; a model trained on that
    mix learns to copy the tool's output by position, for 6 digits, and misses every 5-digit
    answer (measured: GRPO then stalls at exactly the eval set's 6-digit share).
    """
    rng = random.Random(seed)
    while True:
        five_digits = rng.random() < 0.5
        while True:
            template = rng.choice(TEMPLATES)
            expression = template.format(a=rng.randint(100, 999), b=rng.randint(100, 999), c=rng.randint(100, 999))
            if (len(str(eval_expression(expression))) == 5) == five_digits:
                break
        yield expression


def _unique(seed: int, n: int, exclude: set[str]) -> list[str]:
    out: list[str] = []
    for expression in _expressions(seed):
        if expression not in exclude:
            exclude.add(expression)
            out.append(expression)
            if len(out) == n:
                return out
    raise AssertionError("unreachable")


_EVAL = _unique(2024, EVAL_SIZE, set())
_DEV = _unique(4202, DEV_SIZE, set(_EVAL))
_HELD_OUT = set(_EVAL) | set(_DEV)


def eval_rows() -> list[dict[str, str]]:
    """The fixed held-out eval set (never trained on)."""
    return [row(e) for e in _EVAL]


def dev_rows() -> list[dict[str, str]]:
    """A second held-out set, used only by the warm-start script to measure itself."""
    return [row(e) for e in _DEV]


def train_rows(seed: int) -> Iterator[dict[str, str]]:
    """An endless stream of training problems, excluding every held-out expression."""
    for expression in _expressions(seed):
        if expression not in _HELD_OUT:
            yield row(expression)
