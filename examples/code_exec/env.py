"""The code-execution example's environment: write a function, hidden unit tests score it.

`make_env(context)` is the EnvFactory the rollout worker calls once per episode; the worker
owns the SandboxPool (one per worker, started before the first episode) and passes it in
`context.sandbox_pool`. Rows come from data/train.jsonl and data/eval.jsonl:
`prompt` (shown), `entry_point`, `tests` (hidden asserts), `reference_solution` (never shown;
tests/test_envs.py checks that it passes every test).
"""

from __future__ import annotations

from titanrl.envs import CodeTestsEnv, EnvContext

TEST_TIMEOUT_S = 2.0
"""Per hidden test; the problems are tiny, so anything slower is a hang."""
TOOL_TIMEOUT_S = 5.0
"""Per run_python call the model makes while working."""


def make_env(context: EnvContext) -> CodeTestsEnv:
    """One fresh CodeTestsEnv for one episode, sharing the worker's sandbox pool."""
    return CodeTestsEnv.from_context(context, test_timeout_s=TEST_TIMEOUT_S, tool_timeout_s=TOOL_TIMEOUT_S)


HUMANEVAL_TEST_TIMEOUT_S = 10.0
"""Per HumanEval problem (its `check` runs every assert at once); canonical solutions take < 1 s."""
HUMANEVAL_INSTRUCTIONS = (
    "You are a careful Python programmer. Write the complete function, with the same name and "
    "arguments, in one ```python fenced block."
)


def make_humaneval_env(context: EnvContext) -> CodeTestsEnv:
    """HumanEval mode (humaneval.py): one answer, no tool; the problem's tests score it in the sandbox."""
    return CodeTestsEnv.from_context(context, test_timeout_s=HUMANEVAL_TEST_TIMEOUT_S, use_tool=False,
                                     instructions=HUMANEVAL_INSTRUCTIONS)
