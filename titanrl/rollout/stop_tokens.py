"""The tokens that end a model turn: eos, and `<|im_end|>` for chat models whose eos is `<|endoftext|>`."""

from __future__ import annotations

from typing import Any


def turn_stop_token_ids(tokenizer: Any, eos_token_id: int | None) -> list[int]:
    """eos and the ChatML end of turn, where the tokenizer has them as single tokens."""
    return [t for t in (eos_token_id, _token_id(tokenizer, "<|im_end|>")) if t is not None]


def _token_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None
