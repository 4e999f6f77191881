"""The environment protocol for multi-turn, tool-using episodes.

An episode alternates model turns and environment turns:

    observation = await env.reset(row)           # the prompt text the model sees first
    while True:
        action = <model generates until eos or one of env.stop_strings>
        result = await env.step(action)           # observation, reward, done, info
        if result.done: break
        <result.observation is appended to the context; the model continues>

The rollout worker runs this loop token-in/token-out: the tokens the model generated are
kept exactly as sampled (never re-tokenized), observation tokens are appended after them
and masked out of the loss, and turn/token budgets end episodes that run long. One fresh
`Environment` instance serves one episode; `make_env(context)` builds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What the environment returns for one model turn."""

    observation: str
    """Text inserted before the model's next turn (e.g. a tool response); ignored when done."""
    reward: float = 0.0
    """Reward for this turn; an episode's reward is the sum over its turns."""
    done: bool = False
    """True ends the episode."""
    info: dict[str, Any] = field(default_factory=dict)
    """Counters the worker aggregates into metrics: `tool_calls` (int), `errors` (int), `sandbox_s` (float)."""


@dataclass
class EnvContext:
    """Per-worker resources shared by all episodes of that worker."""

    sandbox_pool: Any = None
    """A started `titanrl.envs.SandboxPool` (None when the environment needs no code execution)."""
    worker_id: int = 0
    """Index of the rollout worker running the episode."""
    tokenizer: Any = None
    """The worker's tokenizer (the checkpoint's): environments format chat turns with its chat template."""


class Environment(ABC):
    """One episode of a multi-turn task. Subclasses implement `reset` and `step`."""

    stop_strings: tuple[str, ...] = ()
    """Strings that end a model turn besides eos (e.g. "</tool_call>"); kept in the output."""

    @abstractmethod
    async def reset(self, row: dict[str, Any]) -> str:
        """Starts an episode for one dataset row; returns the first observation (the prompt)."""

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """Consumes the model's turn (decoded text) and returns what happens next."""

    async def close(self) -> None:
        """Releases per-episode resources; called once, whatever happened."""


EnvFactory = Callable[[EnvContext], Environment]
"""Builds a fresh Environment for one episode."""
