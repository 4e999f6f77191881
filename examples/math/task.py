"""Math word problems in GSM8K's format, generated (no download), and the example's tiny policy.

A row is `{"question": ..., "answer": "<worked solution>\\n#### <number>"}`, exactly the columns
of GSM8K's Parquet files, so `--data.train_file=/path/to/gsm8k/main/train-*.parquet` trains on
the real dataset with the same config. The reward is `titanrl.rewards.math_answer`
(math-verify equivalence of the final answers); the prompt is the question as one user message
under the checkpoint's chat template, after `SYSTEM_PROMPT`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent

SYSTEM_PROMPT = ("Solve the math word problem. Reason step by step, then write the final answer as a number "
                 "on the last line after '#### '.")
"""Asks for GSM8K's answer format, which the reward reads first (it also reads \\boxed{})."""
TRAIN_SIZE, EVAL_SIZE = 256, 64
"""Rows of data/train.jsonl and data/eval.jsonl (disjoint questions)."""
TINY_CHECKPOINT = HERE / "tiny"
"""Where `tiny_checkpoint()` writes the example's random tiny Qwen3 (not in git)."""

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro")
ITEMS = ("apples", "stickers", "marbles", "books", "pencils", "cookies")


def _gain_and_give(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(5, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b)
    total, left = a + b, a + b - c
    question = (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to a friend. "
                f"How many {item} does {name} have now?")
    answer = (f"After buying more, {name} has {a}+{b} = <<{a}+{b}={total}>>{total} {item}.\n"
              f"After giving {c} away, {name} has {total}-{c} = <<{total}-{c}={left}>>{left} {item}.\n#### {left}")
    return question, answer, left


def _boxes(rng: random.Random) -> tuple[str, str, int]:
    item, a, b = rng.choice(ITEMS), rng.randint(3, 24), rng.randint(2, 15)
    question = f"A box holds {a} {item}. How many {item} are in {b} boxes?"
    return question, f"{b} boxes hold {b}*{a} = <<{b}*{a}={a * b}>>{a * b} {item}.\n#### {a * b}", a * b


def _share(rng: random.Random) -> tuple[str, str, int]:
    name, item, each, friends = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 20), rng.randint(2, 9)
    total = each * friends
    question = f"{name} shares {total} {item} equally among {friends} friends. How many {item} does each friend get?"
    return question, f"Each friend gets {total}/{friends} = <<{total}/{friends}={each}>>{each} {item}.\n#### {each}", each


def _wages(rng: random.Random) -> tuple[str, str, int]:
    name, rate, mon, tue = rng.choice(NAMES), rng.randint(8, 30), rng.randint(1, 8), rng.randint(1, 8)
    hours, pay = mon + tue, rate * (mon + tue)
    question = (f"{name} earns ${rate} per hour, works {mon} hours on Monday and {tue} hours on Tuesday. "
                f"How many dollars does {name} earn in total?")
    answer = (f"{name} works {mon}+{tue} = <<{mon}+{tue}={hours}>>{hours} hours.\n"
              f"{name} earns {hours}*{rate} = <<{hours}*{rate}={pay}>>{pay} dollars.\n#### {pay}")
    return question, answer, pay


PROBLEMS: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (_gain_and_give, _boxes, _share, _wages)
"""Problem generators: each returns (question, GSM8K-style worked answer, the number it ends with)."""


def problems(seed: int, n: int, exclude: set[str] | None = None) -> list[dict[str, str]]:
    """`n` rows with distinct questions (none in `exclude`), the same for the same seed."""
    rng, seen, rows = random.Random(seed), set(exclude or ()), []
    while len(rows) < n:
        question, answer, _ = rng.choice(PROBLEMS)(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer})
    return rows


def splits() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, eval) rows of data/: eval first, so its questions are held out of train."""
    evals = problems(seed=1, n=EVAL_SIZE)
    return problems(seed=0, n=TRAIN_SIZE, exclude={r["question"] for r in evals}), evals


def tiny_checkpoint() -> Path:
    """The example's policy: a random tiny Qwen3 with the byte tokenizer (its chat template is
    ChatML), written on first use. It will not learn arithmetic in a few steps; it shows the
    pipeline runs. Any HF Qwen3 checkpoint replaces it through --model.checkpoint."""
    if not (TINY_CHECKPOINT / "config.json").is_file():
        from titanrl.models.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(TINY_CHECKPOINT, seed=0)
    return TINY_CHECKPOINT
