"""Shape buckets of the XLA step: every distinct input shape is a new compiled program, so rows
and sequence length are rounded up to a small set (zero rows and columns carry loss mask 0, and
causal attention keeps the real tokens' results unchanged)."""

from __future__ import annotations

MIN_LENGTH_BUCKET = 16
"""Shortest sequence-length bucket: tiny batches share one program."""


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def length_bucket(tokens: int, multiple: int = 1) -> int:
    """The sequence length a batch runs at: the next power of two >= `tokens` (at least
    MIN_LENGTH_BUCKET), rounded up to `multiple`."""
    bucket = _power_of_two_at_least(max(tokens, MIN_LENGTH_BUCKET))
    return -(-bucket // multiple) * multiple


def row_bucket(rows: int, micro_batch_size: int) -> tuple[int, int]:
    """(rows the batch is padded to, rows per micro-batch): below one micro-batch, the next power
    of two (capped at micro_batch_size); above, whole micro-batches whose count is a power of two."""
    if rows <= micro_batch_size:
        micro = min(_power_of_two_at_least(rows), micro_batch_size)
        return micro, micro
    return micro_batch_size * _power_of_two_at_least(-(-rows // micro_batch_size)), micro_batch_size
