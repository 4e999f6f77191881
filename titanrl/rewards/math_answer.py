"""Math answer equivalence through `math-verify`: 1.0 when a completion's final answer equals the
reference, however either is written (`1/2`, `0.5`, `\\frac{2}{4}`, `$\\boxed{\\tfrac12}$`, `1,234`).

The final answer of a text is what follows its last `####` (GSM8K's marker, in references and in
completions trained on that format); without one, `math_verify.parse` picks it out of the whole
text (the last `\\boxed{}` first, else the answer it finds). The reference comes from the row's
`answer` field, so a GSM8K row (`{"question": ..., "answer": "... #### 72"}`) scores as is.

math-verify's own timeouts use `signal.alarm`, which only works in a process's main thread;
rewards run in the worker's helper threads, so they are off here and `reward_timeout_s` bounds
each call instead.
"""

from __future__ import annotations

from typing import Any

ANSWER_MARKER = "####"
"""GSM8K writes the final answer after this marker: `... so she has 72 left.\\n#### 72`."""


def final_answer(text: str) -> str:
    """The part of `text` that holds its final answer: after the last `####`, else all of it."""
    head, marker, tail = text.rpartition(ANSWER_MARKER)
    return tail.strip() if marker else text


def parse_answer(text: str) -> list[Any]:
    """math-verify's reading of a text's final answer ([] when there is none)."""
    from math_verify import parse

    answer = final_answer(text)
    if ANSWER_MARKER in text and "\\" in answer and "$" not in answer:
        answer = f"${answer}$"  # bare LaTeX after `####` (`2\\sqrt{2}`) is read as math only inside $...$
    return parse(answer, parsing_timeout=None)


def answers_match(reference: str, completion: str) -> bool:
    """Whether the final answers of the two texts are mathematically equal."""
    from math_verify import verify

    gold, guess = parse_answer(reference), parse_answer(completion)
    return bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=None)


def math_answer(prompt: str, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 when the completion's final answer equals the row's `answer` (math-verify), else 0.0.

    A row without an `answer` field is a dataset error (it raises), not a wrong answer."""
    if answer is None:
        raise ValueError("math_answer needs the reference in the row's 'answer' field")
    return 1.0 if answers_match(str(answer), completion) else 0.0
