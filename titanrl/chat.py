"""Chat prompts: a checkpoint tokenizer's own chat template, with hand-written ChatML as the fallback.

`render_chat(tokenizer, messages, tools=...)` is the one place a list of `{"role", "content"}`
messages becomes prompt text. A tokenizer with a chat template renders it through
`tokenizer.apply_chat_template(..., add_generation_prompt=True)` (tool schemas included, for
templates that take them); one without a template (or no tokenizer at all) gets ChatML, the
format Qwen models and the tiny byte-level checkpoints use:

    <|im_start|>system
    ...<|im_end|>
    <|im_start|>user
    ...<|im_end|>
    <|im_start|>assistant

A leaf module: it imports nothing of titanrl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The fallback written as a Jinja chat template (the byte-level tokenizer ships it); it ignores tools."""


def chat_turn(role: str, content: str) -> str:
    """One ChatML turn: `<|im_start|>role\\ncontent<|im_end|>\\n`."""
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def has_chat_template(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the tokenizer carries a chat template of its own (or `chat_template` replaces it)."""
    return bool(chat_template) or (tokenizer is not None and bool(getattr(tokenizer, "chat_template", None)))


def template_takes_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the tokenizer's chat template (or `chat_template`, which replaces it) renders a
    `tools` list (a template that never reads the variable would drop the tool schemas silently)."""
    template = chat_template or (getattr(tokenizer, "chat_template", None) if tokenizer is not None else None)
    if isinstance(template, dict):  # named templates: the "tool_use" one, else the default
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, encoded_with_specials: bool = True,
                chat_template: str | None = None) -> str:
    """Prompt text of `messages` (and `tools`, JSON schemas as `transformers.utils.get_json_schema`
    writes them) under the tokenizer's chat template, or ChatML without one.

    `encoded_with_specials`: the text will be encoded with the tokenizer's special tokens added
    (vLLM encodes text prompts so); a BOS the template writes is then left to the tokenizer.
    `chat_template`: a Jinja template used instead of the tokenizer's (`agent.chat_template`).
    Raises ValueError when tools are given to a template that cannot show them: the caller then
    writes the tools into the system message itself (as `titanrl.envs.ToolEnv` does).
    """
    if tools and not template_takes_tools(tokenizer, chat_template):
        raise ValueError("this tokenizer's chat template does not render tools; put them in the system message")
    if not has_chat_template(tokenizer, chat_template):
        text = "".join(chat_turn(m["role"], m["content"]) for m in messages)
        return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")
    text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, chat_template=chat_template)
    return _without_added_bos(tokenizer, text) if encoded_with_specials else text


def _without_added_bos(tokenizer: Any, text: str) -> str:
    """Templates that write the BOS token themselves (Llama-style) would get a second one from a
    tokenizer that adds it when encoding the prompt text: keep only the tokenizer's."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not text.startswith(bos):
        return text
    try:
        adds_bos = tokenizer("", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode "" adds nothing we know of
        adds_bos = False
    return text[len(bos):] if adds_bos else text
