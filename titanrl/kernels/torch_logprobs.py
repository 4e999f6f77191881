"""Batch-invariant log-softmax and token log-probabilities on CPU.

Contract: a row's log-probabilities depend only on that row's logits (and the temperature),
never on the other rows, their number or the row's position; the same for the gradient.

Why torch's own `log_softmax` suffices (measured, torch 2.13 CPU, 1/2/4 threads, vocabularies
1 to 151,936, 1 to 1,000 rows; re-checked in tests/test_kernels.py): its last-dimension kernel
gives each row to one thread and reduces it (max, then sum of exp) in one vectorized order
that depends only on the row's length. Its backward reduces each row the same way. The input
must be contiguous in the vocabulary dimension, so it is made contiguous first.
`token_logprobs` is exactly `titanrl.trainer.grpo.token_logprobs`, op for op, so the
generator and the trainer can call one function and get the same bits.
"""

from __future__ import annotations

import torch


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) over the last dimension, in float32 (float64 stays)."""
    if temperature <= 0:
        raise ValueError(f"log_softmax: temperature must be positive, got {temperature}")
    x = logits.contiguous()
    x = x if x.dtype == torch.float64 else x.float()
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature): [..., V] logits, [...] targets -> [...]."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"token_logprobs: targets {tuple(targets.shape)} must match logits without the vocabulary "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    return log_softmax(logits, temperature).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
