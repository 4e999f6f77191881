"""The OpenAI request bodies the endpoint accepts, as pydantic models (validation, not parsing by hand).

Only the fields the endpoint honours are declared; any other field is refused by name
(`extra="forbid"`), so a harness never believes a setting took effect when it did not. Responses
are built with the `openai` package's own response models (`titanrl.agents.responses`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    """The served model name (`agent.served_model_name`)."""
    n: int = Field(1, ge=1, le=16)
    """Choices to sample from the one prompt."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """Must equal rollout.sampling.temperature (the trainer scores tokens at that temperature); None: the run's."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """Must equal rollout.sampling.top_p; None: the run's."""
    max_tokens: int | None = Field(None, ge=1)
    """Completion tokens per choice; None: rollout.sampling.max_new_tokens (or what the context has room for)."""
    stop: str | list[str] | None = None
    """Up to 4 strings that end a choice; the text returned stops before them (their tokens are kept for training)."""
    seed: int | None = Field(None, ge=0, lt=2**63)
    """Seed of choice 0 (choice i adds i); None: the run's own seed for this call of this episode."""
    stream: Literal[False] = False
    """Streaming is not served."""
    user: str | None = None
    """Accepted and ignored (OpenAI's end-user id)."""

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Request):
    """`POST /v1/chat/completions`."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    """The conversation, rendered with the checkpoint's chat template (or `agent.chat_template`)."""
    tools: list[dict[str, Any]] | None = None
    """Function tools (`{"type": "function", "function": {...}}`), passed to the chat template;
    with tools, a reply's `<tool_call>` blocks come back as `tool_calls`."""
    tool_choice: Literal["auto", "none"] | None = None
    """'none' returns tool-call text as content; 'auto' (the default with tools) parses it."""
    logprobs: bool = False
    """Return the log-probability of each sampled token (top alternatives are not served)."""
    top_logprobs: Literal[0] | None = None
    """Only 0: alternatives to the sampled token are not served."""
    parallel_tool_calls: bool | None = None
    """Accepted; a reply may hold several calls either way."""


class CompletionRequest(_Request):
    """`POST /v1/completions`."""

    prompt: str | list[int]
    """Prompt text (tokenized as vLLM does, special tokens such as BOS added) or token ids."""
    logprobs: Literal[0] | None = None
    """0: return the sampled tokens' log-probabilities; None: none."""
    echo: Literal[False] = False
    """Echoing the prompt is not served."""
