"""ToolEnv: a generic multi-turn environment where the model calls tools, then answers.

Prompt (what `reset` returns; the chat format of the tiny checkpoints' template, which is
ChatML as Qwen models use):

    <|im_start|>system
    {tools prompt: tool schemas + call format}

    {instructions}<|im_end|>
    <|im_start|>user
    {row["prompt"]}<|im_end|>
    <|im_start|>assistant

A model turn ends at eos or at the stop string `</tool_call>` (kept in the text). Then:

- the turn contains a tool call -> the calls run and the observation closes the assistant
  turn, adds a tool turn with one `<tool_response>` block per call, and opens the next
  assistant turn (done=False, reward 0):

      <|im_end|>
      <|im_start|>tool
      <tool_response>
      ...
      </tool_response><|im_end|>
      <|im_start|>assistant

  (the leading `<|im_end|>` is left out if the action already ends with it.)
- otherwise the turn is the final answer: trailing `<|im_end|>` / `<|endoftext|>` are stripped,
  reward = `await self.score(row, answer)`, done=True.

`StepResult.info` holds this turn's counts (sum them over the episode's steps): `tool_calls`,
`errors` (malformed/failed calls, scoring errors) and `sandbox_s`; `self.stats` holds the
episode's running totals. Like every Environment, one instance serves one episode.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from titanrl.envs.base import Environment, StepResult
from titanrl.envs.tools import TOOL_CALL_CLOSE, Tool, ToolRegistry, parse_tool_calls

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

ScoreFn = Callable[[dict[str, Any], str], "float | Awaitable[float]"]


@dataclass
class EpisodeStats:
    """Running counters of one episode (StepResult.info carries their per-turn increments)."""

    tool_calls: int = 0
    """Tool calls the model made, well-formed or not."""
    errors: int = 0
    """Calls that produced an error response, plus failures while scoring the answer."""
    sandbox_s: float = 0.0
    """Seconds spent running code in the sandbox (tools and scoring)."""


def chat_turn(role: str, content: str) -> str:
    """One ChatML turn: `<|im_start|>role\\ncontent<|im_end|>\\n`."""
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def strip_end_tokens(text: str) -> str:
    """The answer without trailing end-of-turn / end-of-text markers and whitespace."""
    text = text.rstrip()
    while text.endswith((IM_END, EOS)):
        text = text[: -len(IM_END) if text.endswith(IM_END) else -len(EOS)].rstrip()
    return text


class ToolEnv(Environment):
    """Tools + a task; the first reply without a tool call is scored.

    Subclass and override `score` (and optionally `instructions` / `user_prompt`), or pass `score`.
    """

    stop_strings = (TOOL_CALL_CLOSE,)

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]], *, instructions: str = "",
                 score: ScoreFn | None = None, max_calls_per_turn: int = 4,
                 tool_timeout_s: float = 60.0, max_response_chars: int = 4000) -> None:
        self.registry = ToolRegistry(tools, timeout_s=tool_timeout_s, max_response_chars=max_response_chars)
        self.instructions = instructions
        self._score_fn = score
        self.max_calls_per_turn = max_calls_per_turn
        """More calls than this in one turn are answered with an error each (bounds work per turn)."""
        self.stats = EpisodeStats()
        self.row: dict[str, Any] = {}

    def system_prompt(self, row: dict[str, Any]) -> str:
        """Tools section, then the task instructions."""
        parts = [self.registry.prompt(), self.instructions]
        return "\n\n".join(p for p in parts if p)

    def user_prompt(self, row: dict[str, Any]) -> str:
        """The task as the user states it: the row's `prompt` field."""
        return str(row["prompt"])

    async def reset(self, row: dict[str, Any]) -> str:
        self.row = row  # One instance serves one episode, so self.stats needs no reset.
        return (chat_turn("system", self.system_prompt(row)) + chat_turn("user", self.user_prompt(row))
                + f"{IM_START}assistant\n")

    async def step(self, action: str) -> StepResult:
        before = asdict(self.stats)
        calls = parse_tool_calls(action)
        if calls:
            responses = []
            for i, call in enumerate(calls):
                self.stats.tool_calls += 1
                if i >= self.max_calls_per_turn:
                    call.error = f"at most {self.max_calls_per_turn} tool calls per turn"
                outcome = await self.registry.call(call)
                self.stats.errors += outcome.error is not None
                responses.append(outcome.text)
            close = "" if action.rstrip().endswith(IM_END) else f"{IM_END}\n"
            observation = close + chat_turn("tool", "\n".join(responses)) + f"{IM_START}assistant\n"
            return StepResult(observation, 0.0, False, self._delta(before))
        reward = await self.score(self.row, strip_end_tokens(action))
        return StepResult("", float(reward), True, self._delta(before))

    async def score(self, row: dict[str, Any], answer: str) -> float:
        """Reward of the final answer. Override, or pass `score=` (sync or async)."""
        if self._score_fn is None:
            raise NotImplementedError(f"{type(self).__name__} needs a score() override or score= argument")
        result = self._score_fn(row, answer)
        return float(await result if inspect.isawaitable(result) else result)

    def _delta(self, before: dict[str, Any]) -> dict[str, Any]:
        now = asdict(self.stats)
        return {k: now[k] - before[k] for k in now}
