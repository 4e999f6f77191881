"""The tool agent as a plain OpenAI-client agent loop: what an agent builder already has.

`agent(base_url, api_key, row)` plays one episode against any OpenAI-compatible server and
returns its reward; TitanRL calls it with its rollout worker's endpoint. It asks for the
product, runs each `python` tool call in the sandbox the worker hands it, sends the output
back, and scores the final answer: 1.0 when it is exactly the product and at least one
`python` call ran, else 0 (the rules of examples/tool_agent).

Nothing here but `episode_sandbox` comes from titanrl: swap in your own sandbox and this file
runs against vLLM's or OpenAI's server unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import openai

from titanrl.agents import episode_sandbox

TOOLS = [{
    "type": "function",
    "function": {
        "name": "python",
        "description": "runs code.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}]
"""One tool, `python(code)`; the example's chat template renders it as the tool agent's system prompt."""
MAX_CALLS = 3
"""Model calls per episode (the tool agent's env.max_turns)."""
MAX_TOKENS = 96
"""Tokens per reply: a call is ~70 byte tokens, an answer at most 7."""


_clients: dict[str, openai.AsyncOpenAI] = {}
"""One client (one HTTP connection pool) per server, shared by the episodes: making a client
costs ~25 ms (its TLS context), more than an episode's calls."""


async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    if base_url not in _clients:
        _clients[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client = _clients[base_url].with_options(api_key=api_key)  # this episode's key, the shared pool
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    python_ran = False
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS,
            stop=["</tool_call>"],  # a call ends at its closing tag; the tool answers next
        )
        message = reply.choices[0].message
        if not message.tool_calls:  # the final answer
            return 1.0 if python_ran and (message.content or "").strip() == row["answer"] else 0.0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            output, ok = await run_tool(call.function.name, call.function.arguments)
            python_ran = python_ran or ok
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0.0  # out of calls without an answer


async def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """The tool's output text, and whether a `python` program ran."""
    if name != "python":
        return f"error: unknown tool {name!r}; available: python", False
    try:
        code = json.loads(arguments)["code"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return "error: python takes {\"code\": \"...\"}", False
    return await episode_sandbox().run_python(code), True
