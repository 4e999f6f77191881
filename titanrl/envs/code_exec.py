"""Code execution: a `run_python` tool and an environment rewarded by hidden unit tests.

CodeTestsEnv rows:

    {"prompt": "Write a function `gcd(a: int, b: int) -> int` ...",   # shown to the model
     "entry_point": "gcd",                                          # name the tests call
     "tests": ["assert gcd(12, 18) == 6", ...],                     # hidden from the model
     "code_prefix": "import math\ndef gcd(a, b):\n    ..."}          # optional (see answer_program)

The model may call `run_python` to try code (stdout/stderr come back as a tool response),
then answers. The answer's code is the last ```python (or bare ```) fenced block, or the
whole answer when it has no fence, run after the row's optional `code_prefix`; reward = fraction of tests passed (see
titanrl/rewards/code_tests.py for how each test runs in isolation). A syntax error, a crash
or a hang while loading the code, a test timeout or a sandbox failure adds 1 to
info["errors"]; info also gets `tests_passed` and `tests_total` on the final turn.
"""

from __future__ import annotations

import re
import time
from typing import Any

from titanrl.envs.base import EnvContext, StepResult
from titanrl.envs.tool_env import EpisodeStats, ToolEnv
from titanrl.envs.tools import Tool, truncate_middle
from titanrl.rewards.code_tests import fraction_of_tests_passed

_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL | re.IGNORECASE)

CODE_INSTRUCTIONS = (
    "Solve the task with a Python function. You may test code with run_python first. "
    "Then give your final answer without a tool call: the complete function in one "
    "```python fenced block."
)


def extract_code(answer: str) -> str:
    """The last fenced code block of `answer`, or the whole answer when it has none."""
    blocks = _FENCE_RE.findall(answer)
    return blocks[-1] if blocks else answer


def answer_program(row: dict[str, Any], answer: str) -> str:
    """The program the tests run against: the answer's code, after the row's `code_prefix` when
    it has one (HumanEval: imports, helpers and the stub). An answer that defines the entry point
    follows the prefix as a new block; one that does not is taken as the stub's body."""
    code = extract_code(answer)
    prefix = row.get("code_prefix") or ""
    if not prefix:
        return code
    defines = re.search(rf"^\s*def\s+{re.escape(row.get('entry_point') or '')}\s*\(", code, re.MULTILINE)
    if defines:
        return prefix.rstrip() + "\n\n\n" + code
    return (prefix if prefix.endswith("\n") else prefix + "\n") + code


class PythonTool:
    """`run_python(code)` backed by a SandboxPool; counts sandbox seconds into `stats`."""

    def __init__(self, pool: Any, stats: EpisodeStats | None = None, *, timeout_s: float = 5.0,
                 max_output_chars: int = 2000) -> None:
        self.pool = pool
        self.stats = stats if stats is not None else EpisodeStats()
        """Where sandbox time is added (the environment's running totals)."""
        self.timeout_s = timeout_s
        """Wall-clock limit per program."""
        self.max_output_chars = max_output_chars
        """Budget for stdout and for stderr each, so a chatty program cannot flood the context."""

    async def run_python(self, code: str) -> str:
        """Runs a Python program in a sandbox and returns its stdout, stderr and exit status.

        Args:
            code: the complete program; print what you want to see.
        """
        start = time.perf_counter()
        try:
            result = await self.pool.run(code, timeout_s=self.timeout_s)
        finally:
            self.stats.sandbox_s += time.perf_counter() - start
        parts = []
        if result.stdout:
            parts.append("stdout:\n" + truncate_middle(result.stdout, self.max_output_chars))
        if result.stderr:
            parts.append("stderr:\n" + truncate_middle(result.stderr, self.max_output_chars))
        if result.timed_out:
            parts.append(f"timed out after {self.timeout_s:g} s")
        else:
            parts.append(f"exit code: {result.returncode}")
        return "\n".join(parts)

    def as_tool(self) -> Tool:
        """The Tool the registry shows as `run_python(code: str)`."""
        return Tool.from_function(self.run_python)


class CodeTestsEnv(ToolEnv):
    """The model writes a function; the sandbox runs the row's hidden asserts against it."""

    def __init__(self, pool: Any, *, test_timeout_s: float = 2.0, tool_timeout_s: float = 5.0,
                 use_tool: bool = True, instructions: str = CODE_INSTRUCTIONS, **tool_env_kwargs: Any) -> None:
        if pool is None:
            raise ValueError("CodeTestsEnv needs a started SandboxPool (EnvContext.sandbox_pool is None)")
        self.pool = pool
        self.test_timeout_s = test_timeout_s
        """Limit per hidden test (and for loading the answer's code)."""
        self.python = PythonTool(pool, timeout_s=tool_timeout_s)
        super().__init__([self.python.as_tool()] if use_tool else [], instructions=instructions, **tool_env_kwargs)
        self.python.stats = self.stats  # tool time counts toward the episode's sandbox_s
        self._last_tests: dict[str, int] = {}

    @classmethod
    def from_context(cls, context: EnvContext, **kwargs: Any) -> CodeTestsEnv:
        """The `make_env` body: one environment per episode, sharing the worker's pool (and
        formatting turns with the worker tokenizer's chat template)."""
        return cls(context.sandbox_pool, **{"tokenizer": context.tokenizer, **kwargs})

    def system_prompt(self, row: dict[str, Any]) -> str:
        # Without tools the tools section would only confuse the model.
        return super().system_prompt(row) if self.registry.tools else self.instructions

    async def reset(self, row: dict[str, Any]) -> str:
        tests = row.get("tests")
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"CodeTestsEnv row needs a non-empty list of assert strings in 'tests': {row!r:.200}")
        for t in tests:  # A dataset bug should be loud, not a silent zero reward.
            compile(t, "<test>", "exec")
        return await super().reset(row)

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        if result.done:
            result.info.update(self._last_tests)
        return result

    async def score(self, row: dict[str, Any], answer: str) -> float:
        fraction, details = await fraction_of_tests_passed(self.pool, answer_program(row, answer), row["tests"],
                                                           self.test_timeout_s)
        self.stats.sandbox_s += details["sandbox_s"]
        self.stats.errors += details["error"] is not None
        self._last_tests = {"tests_passed": details["passed"], "tests_total": details["total"]}
        return fraction
