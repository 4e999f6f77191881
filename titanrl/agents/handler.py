"""Serves one endpoint call: checks it, renders and tokenizes the prompt, samples it on the
episode's engine, records it token for token and answers in the `openai` package's own models.

A call never spans two policy versions: when new weights land while it runs (continuous
rollouts), it is sampled again from its start with the new weights (`AgentEpisode.resampled_calls`),
so every call records exactly one version and the version changes only between calls.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from titanrl.agents.calls import CallRecord
from titanrl.agents.episodes import AgentEpisode, EndpointError
from titanrl.agents.protocol import ChatCompletionRequest, CompletionRequest, _Request
from titanrl.chat import render_chat, template_takes_tools
from titanrl.envs.tools import TOOL_CALL_OPEN, parse_tool_calls

MAX_STOP_STRINGS = 4
"""As OpenAI's API: at most four stop strings per request."""
TOOL_CALL_FORMATS = {"hermes": (TOOL_CALL_OPEN, parse_tool_calls)}
"""A family's `ModelSpec.tool_call_format` -> (the text that opens a call, the parser of a reply's calls)."""


@dataclass
class CallSettings:
    """What every call is checked against and sampled with (the run's rollout settings)."""

    served_model_name: str
    temperature: float
    """rollout.sampling.temperature: the trainer scores tokens at it, so calls must sample at it."""
    top_p: float
    top_k: int
    max_new_tokens: int
    """Default max_tokens of a call."""
    max_model_len: int
    stop_token_ids: list[int]
    """Tokens that end every choice (eos, and the chat format's end of turn)."""
    max_calls: int
    vocab_size: int
    tool_call_format: str = "hermes"
    """The family's (`ModelSpec.tool_call_format`): how replies' tool calls are parsed."""
    chat_template: str | None = None
    """Replaces the tokenizer's chat template (`agent.chat_template`)."""


class CallHandler:
    """The endpoint's two routes, without HTTP (`titanrl.agents.server` wraps them)."""

    def __init__(self, tokenizer: Any, settings: CallSettings) -> None:
        self.tokenizer, self.settings = tokenizer, settings

    # ------------------------------------------------------------------ routes
    async def chat(self, episode: AgentEpisode, request: ChatCompletionRequest) -> Any:
        from openai.types.chat import ChatCompletion

        self._check_model(request)
        messages = [_message(m, i) for i, m in enumerate(request.messages)]
        tools = request.tools or None
        if tools and not template_takes_tools(self.tokenizer, self.settings.chat_template):
            raise EndpointError(400, "this model's chat template does not render tools: describe the tools in the "
                                "system message (and omit `tools`), or set agent.chat_template to a template "
                                "that renders them", param="tools")
        try:
            text = render_chat(self.tokenizer, messages, tools=tools, encoded_with_specials=False,
                               chat_template=self.settings.chat_template)
        except Exception as e:  # a template that cannot render these messages: the caller's to fix
            raise EndpointError(400, f"the chat template could not render the messages: {e}", param="messages") from e
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        completions = await self._sample(episode, prompt_ids, request, "messages")
        parse_calls = bool(tools) and request.tool_choice != "none"
        choices = [self._chat_choice(i, c, request, parse_calls, episode) for i, c in enumerate(completions)]
        return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
                              model=request.model, choices=choices, usage=_usage(prompt_ids, completions))

    async def complete(self, episode: AgentEpisode, request: CompletionRequest) -> Any:
        from openai.types.completion import Completion
        from openai.types.completion_choice import CompletionChoice, Logprobs

        self._check_model(request)
        if isinstance(request.prompt, str):
            prompt_ids = self.tokenizer.encode(request.prompt, add_special_tokens=True)
        else:
            prompt_ids = list(request.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.settings.vocab_size]
            if bad:
                raise EndpointError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.settings.vocab_size})",
                                    param="prompt")
        completions = await self._sample(episode, prompt_ids, request, "prompt")
        choices = []
        for i, c in enumerate(completions):
            text = _without_stop(c.text, request.stop_strings(), c.finish_reason)
            logprobs = None
            if request.logprobs is not None:
                tokens = [self.tokenizer.decode([t]) for t in c.token_ids]
                offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
                logprobs = Logprobs(tokens=tokens, token_logprobs=list(c.logprobs), text_offset=offsets)
            choices.append(CompletionChoice(index=i, text=text, finish_reason=_finish(c.finish_reason),
                                            logprobs=logprobs))
        return Completion(id=f"cmpl-{uuid.uuid4().hex}", object="text_completion", created=int(time.time()),
                          model=request.model, choices=choices, usage=_usage(prompt_ids, completions))

    # ------------------------------------------------------------------ sampling
    async def _sample(self, episode: AgentEpisode, prompt_ids: list[int], request: _Request, prompt_param: str) -> list:
        from titanrl.rollout.vllm.async_engine import WeightsChanged

        s = self.settings
        if episode.choices + request.n > s.max_calls:
            raise EndpointError(429, f"this episode has made {episode.choices} of its agent.max_calls={s.max_calls} "
                                f"calls (choices counted); {request.n} more do not fit", type="rate_limit_error",
                                code="max_calls_exceeded")
        temperature, top_p = self._sampling(episode, request)
        if not prompt_ids:
            raise EndpointError(400, "the prompt is empty", param=prompt_param)
        room = s.max_model_len - len(prompt_ids)
        if room < 1:
            raise EndpointError(400, f"the prompt is {len(prompt_ids)} tokens; the engine's context "
                                f"(rollout.engine.max_model_len) is {s.max_model_len}", param=prompt_param,
                                code="context_length_exceeded")
        if request.max_tokens is not None and request.max_tokens > room:
            raise EndpointError(400, f"max_tokens={request.max_tokens} does not fit: the prompt is {len(prompt_ids)} "
                                f"tokens of the {s.max_model_len}-token context", param="max_tokens",
                                code="context_length_exceeded")
        stop = request.stop_strings()
        if len(stop) > MAX_STOP_STRINGS or not all(stop):
            raise EndpointError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
        seed = request.seed if request.seed is not None else (
            None if episode.seed is None else episode.seed + episode.choices)
        while True:
            try:
                completions = await episode.generator.generate_n(
                    prompt_ids, n=request.n, temperature=temperature, top_p=top_p,
                    top_k=s.top_k if temperature > 0 else 0,
                    max_tokens=request.max_tokens or min(s.max_new_tokens, room), seed=seed, stop=stop,
                    stop_token_ids=s.stop_token_ids)
            except WeightsChanged:  # rollout.on_weight_update="regenerate" aborted it
                episode.resampled_calls += 1
                continue
            except Exception as e:  # the engine failed: the worker's error, not this call's
                episode.engine_error = e
                raise
            if all(len(set(c.token_versions)) <= 1 for c in completions):
                break
            episode.resampled_calls += 1  # new weights landed mid-call: sample it again with them
        if not episode.open:  # the episode timed out while this call ran: nothing of it is kept
            raise EndpointError(401, f"episode {episode.episode_id!r} ended while this call ran",
                                type="authentication_error", code="episode_closed")
        for c in completions:
            episode.calls.append(CallRecord(
                call_index=episode.num_calls, prompt_ids=list(prompt_ids), completion_ids=list(c.token_ids),
                logprobs=list(c.logprobs), version=c.policy_version, text=c.text,
                finished=c.finish_reason != "length"))
        episode.num_calls += 1
        return completions

    def _sampling(self, episode: AgentEpisode, request: _Request) -> tuple[float, float]:
        """(temperature, top_p) of a call: the run's, which the trainer scores tokens under; an
        evaluation episode is greedy whatever it asks."""
        s = self.settings
        for name, run_value in (("temperature", s.temperature), ("top_p", s.top_p)):
            asked = getattr(request, name)
            if asked is not None and asked != run_value and not episode.greedy:
                raise EndpointError(400, f"{name}={asked} differs from the run's rollout.sampling.{name}={run_value}: "
                                    f"the trainer scores every token at the run's {name}, so omit {name} or send "
                                    f"{run_value} (or change rollout.sampling.{name})", param=name)
        return (0.0, 1.0) if episode.greedy else (s.temperature, s.top_p)

    def _check_model(self, request: _Request) -> None:
        if request.model != self.settings.served_model_name:
            raise EndpointError(404, f"model {request.model!r} is not served here; this endpoint serves "
                                f"{self.settings.served_model_name!r} (agent.served_model_name)", param="model",
                                code="model_not_found")

    # ------------------------------------------------------------------ responses
    def _chat_choice(self, index: int, c: Any, request: ChatCompletionRequest, parse_calls: bool,
                     episode: AgentEpisode) -> Any:
        from openai.types.chat import ChatCompletionMessage, ChatCompletionTokenLogprob
        from openai.types.chat.chat_completion import Choice, ChoiceLogprobs

        text = _without_stop(c.text, request.stop_strings(), c.finish_reason)
        content: str | None = text
        tool_calls = None
        finish = _finish(c.finish_reason)
        opener, parse = TOOL_CALL_FORMATS[self.settings.tool_call_format]
        if parse_calls and opener in c.text:
            calls = parse(c.text)  # the full text: a stop string may have closed the call
            if calls and all(call.error is None for call in calls):
                content = text[: text.index(opener)] or None
                tool_calls = [{"id": f"call_{episode.episode_id}_{episode.num_calls - 1}_{index}_{k}", "type": "function",
                               "function": {"name": call.name,
                                            "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                              for k, call in enumerate(calls)]
                finish = "tool_calls"
        logprobs = None
        if request.logprobs:
            entries = []
            for token_id, logprob in zip(c.token_ids, c.logprobs, strict=True):
                token = self.tokenizer.decode([token_id])
                entries.append(ChatCompletionTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()),
                                                          top_logprobs=[]))
            logprobs = ChoiceLogprobs(content=entries)
        return Choice(index=index, finish_reason=finish, logprobs=logprobs,
                      message=ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls))


def _message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A request message as chat templates read it: fields that are None are left out (clients
    send `content: null` beside `tool_calls`, and `refusal: null`), `role` is required."""
    if not isinstance(message.get("role"), str):
        raise EndpointError(400, f"messages[{index}] has no string 'role'", param=f"messages[{index}].role")
    return {k: v for k, v in message.items() if v is not None}


def _without_stop(text: str, stop: list[str], finish_reason: str | None) -> str:
    """The text a client sees: a matched stop string is not part of it (as OpenAI's API); its
    tokens stay in the record for training."""
    if finish_reason == "stop":
        for s in stop:
            if text.endswith(s):
                return text[: -len(s)]
    return text


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(prompt_ids: list[int], completions: list[Any]) -> Any:
    from openai.types.completion_usage import CompletionUsage

    completion_tokens = sum(len(c.token_ids) for c in completions)
    return CompletionUsage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                           total_tokens=len(prompt_ids) + completion_tokens)
