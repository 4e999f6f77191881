"""ToolEnv: a generic multi-turn environment where the model calls tools, then answers.

The prompt (what `reset` returns) is the system message (tools + instructions) and the user
message (`row["prompt"]`) under the worker tokenizer's chat template (`EnvContext.tokenizer`,
passed as `tokenizer=`): a template that renders tools gets the tool schemas
(`apply_chat_template(..., tools=[tool.schema() ...])`) and its own tool-turn format; any other
template, or none (hand-written ChatML, the fallback), gets the tools as text in the system
message (`tools_prompt`) and ChatML tool turns. The tiny checkpoints' template is ChatML, so:

    <|im_start|>system
    {tools prompt: tool schemas + call format}

    {instructions}<|im_end|>
    <|im_start|>user
    {row["prompt"]}<|im_end|>
    <|im_start|>assistant

A model turn ends at eos or at the stop string `</tool_call>` (kept in the text). Then:

- the turn contains a tool call -> the calls run and the observation closes the assistant
  turn, adds a tool turn with one `<tool_response>` block per call, and opens the next
  assistant turn (done=False, reward 0); in ChatML:

      <|im_end|>
      <|im_start|>tool
      <tool_response>
      ...
      </tool_response><|im_end|>
      <|im_start|>assistant

  (the leading `<|im_end|>` is left out if the action already ends with it.) Under a template
  that renders tools, the observation is what the template writes after the assistant's
  content: its end of turn, its tool turn(s), its generation prompt.
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

from titanrl.chat import EOS, IM_END, IM_START, chat_turn, render_chat, template_takes_tools
from titanrl.envs.base import Environment, StepResult
from titanrl.envs.tools import TOOL_CALL_CLOSE, Tool, ToolOutcome, ToolRegistry, parse_tool_calls

ACTION_PLACEHOLDER = "\x00titanrl-action\x00"
"""Stands for the model's turn when a template renders what follows it (the turn's own tokens are
kept as sampled; only the text after them is needed, whatever the template does with content)."""

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
                 tool_timeout_s: float = 60.0, max_response_chars: int = 4000, tokenizer: Any = None) -> None:
        self.registry = ToolRegistry(tools, timeout_s=tool_timeout_s, max_response_chars=max_response_chars)
        self.tokenizer = tokenizer
        """The worker's tokenizer (`EnvContext.tokenizer`): its chat template formats the turns; None: ChatML."""
        self.messages: list[dict[str, Any]] = []
        """The conversation so far, as chat messages (what a template renders)."""
        self.instructions = instructions
        self._score_fn = score
        self.max_calls_per_turn = max_calls_per_turn
        """More calls than this in one turn are answered with an error each (bounds work per turn)."""
        self.stats = EpisodeStats()
        self.row: dict[str, Any] = {}

    @property
    def template_renders_tools(self) -> bool:
        """Whether the tokenizer's chat template shows the tools (else the system prompt lists them)."""
        return bool(self.registry.tools) and template_takes_tools(self.tokenizer)

    def system_prompt(self, row: dict[str, Any]) -> str:
        """Tools section (unless the chat template renders the tools), then the task instructions."""
        parts = [self.instructions] if self.template_renders_tools else [self.registry.prompt(), self.instructions]
        return "\n\n".join(p for p in parts if p)

    def user_prompt(self, row: dict[str, Any]) -> str:
        """The task as the user states it: the row's `prompt` field."""
        return str(row["prompt"])

    async def reset(self, row: dict[str, Any]) -> str:
        self.row = row  # One instance serves one episode, so self.stats needs no reset.
        self.messages = [{"role": "system", "content": self.system_prompt(row)},
                         {"role": "user", "content": self.user_prompt(row)}]
        # Episodes encode their text without special tokens, so a template's own BOS stays.
        return render_chat(self.tokenizer, self.messages, tools=self._schemas(), encoded_with_specials=False)

    def _schemas(self) -> list[dict[str, Any]] | None:
        return [t.schema() for t in self.registry.tools.values()] if self.template_renders_tools else None

    def _tool_turn(self, action: str, outcomes: list[ToolOutcome]) -> str:
        """The observation after a turn with tool calls: the end of the assistant turn, the tool
        turn(s) and the next assistant header, in the template's format (or ChatML)."""
        content = strip_end_tokens(action)
        assistant = {"role": "assistant", "content": content}
        tool_messages = [{"role": "tool", "content": o.content} for o in outcomes]
        self.messages += [assistant, *tool_messages]
        if self.template_renders_tools:
            placeholder = {"role": "assistant", "content": ACTION_PLACEHOLDER}
            text = render_chat(self.tokenizer, self.messages[:-len(tool_messages) - 1] + [placeholder, *tool_messages],
                               tools=self._schemas(), encoded_with_specials=False)
            after = text[text.index(ACTION_PLACEHOLDER) + len(ACTION_PLACEHOLDER):]
            written = action[len(content):]  # end-of-turn text the model already wrote
            return after[len(written):] if written and after.startswith(written) else after
        close = "" if action.rstrip().endswith(IM_END) else f"{IM_END}\n"
        return close + chat_turn("tool", "\n".join(o.text for o in outcomes)) + f"{IM_START}assistant\n"

    async def step(self, action: str) -> StepResult:
        before = asdict(self.stats)
        calls = parse_tool_calls(action)
        if calls:
            outcomes = []
            for i, call in enumerate(calls):
                self.stats.tool_calls += 1
                if i >= self.max_calls_per_turn:
                    call.error = f"at most {self.max_calls_per_turn} tool calls per turn"
                outcome = await self.registry.call(call)
                self.stats.errors += outcome.error is not None
                outcomes.append(outcome)
            return StepResult(self._tool_turn(action, outcomes), 0.0, False, self._delta(before))
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
