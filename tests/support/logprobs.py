"""The trainer model's per-token logprobs of whole sequences, from one right-padded forward: what the
batch-invariance tests compare the generator's logprobs with."""

from __future__ import annotations

import torch

from titanrl import kernels


def padded_forward_logprobs(model, sequences: list[list[int]], grad: bool) -> list[torch.Tensor]:
    """Per-token logprobs of each sequence from one right-padded training forward."""
    T = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), T, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    with torch.set_grad_enabled(grad):
        logprobs = kernels.token_logprobs(model(ids[:, :-1]), ids[:, 1:])
    return [logprobs[i, : len(s) - 1].detach() for i, s in enumerate(sequences)]
