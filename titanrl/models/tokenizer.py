"""A byte-level tokenizer built locally with `tokenizers` (no model hub).

One token per byte covers any text, which is what tiny test and example models need:
arithmetic, code, and tool-call markup all tokenize without an unknown token.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from titanrl.chat import CHATML_TEMPLATE

EOS_TOKEN = "<|endoftext|>"
"""End of a completion; also used as the padding token."""
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")


def build_byte_tokenizer() -> Tokenizer:
    """256 byte tokens (ids 0..255, in byte order) followed by the special tokens."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 printable stand-ins by the byte they encode so id == byte value.
    by_byte = sorted(byte_chars, key=_byte_of_char)
    vocab = {ch: i for i, ch in enumerate(by_byte)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _byte_of_char(ch: str) -> int:
    # GPT-2's byte<->unicode table: printable bytes map to themselves, the rest to 256+.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def save_byte_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 2048) -> None:
    """Writes tokenizer.json + tokenizer_config.json that transformers and vLLM load."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    # A minimal chat template so chat-style prompts (envs, tools) have one documented format.
    fast.chat_template = CHATML_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def vocab_size_with_specials() -> int:
    return 256 + len(SPECIAL_TOKENS)
