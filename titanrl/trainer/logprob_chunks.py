"""How many tokens one chunk of the chunked LM head holds (torch-free: `titanrl plan` uses it too)."""

from __future__ import annotations

CHUNK_LOGITS_BYTES = 128 << 20
"""Default size of one chunk's float32 logits (train.memory.logprob_chunk_tokens=None)."""


def chunk_tokens_for(vocab_rows: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk: `chunk_tokens`, or as many as fit CHUNK_LOGITS_BYTES of float32 logits
    over `vocab_rows` head rows (this rank's vocabulary shard): 220 at 151,936 rows."""
    if chunk_tokens is not None:
        return chunk_tokens
    return max(1, CHUNK_LOGITS_BYTES // (4 * max(1, vocab_rows)))
