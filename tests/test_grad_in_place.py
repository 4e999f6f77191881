"""The embedding's gradient added straight into .grad from a step's second micro-batch on
(titanrl/models/common/grad_in_place.py); the LM head's is in tests/test_chunked_logprobs.py."""

from __future__ import annotations

import torch
from torch import nn

import titanrl.models.common.grad_in_place as module
from titanrl.models.common.grad_in_place import embed
from support.new_tensors import ShapesMade


def _two_micro_batches(embedding: nn.Embedding) -> list[list[tuple[int, ...]]]:
    gen = torch.Generator().manual_seed(5)
    made = []
    for _ in range(2):
        ids = torch.randint(embedding.num_embeddings, (3, 7), generator=gen)
        scale = torch.randn(3, 7, embedding.embedding_dim, generator=gen).to(embedding.weight.dtype)
        loss = (embed(embedding, ids) * scale).sum()
        with ShapesMade() as mode:
            loss.backward()
        made.append(mode.shapes)
    return made


def test_a_later_micro_batch_adds_the_embedding_gradient_in_place(monkeypatch):
    """Repeated ids included: the second backward makes no [V, D] tensor, and .grad equals what
    the embedding module's own backward accumulates (float64)."""
    V, D = 500, 12
    start = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    embedding = nn.Embedding(V, D)
    embedding.weight.data.copy_(start)
    made = _two_micro_batches(embedding)
    assert (V, D) in made[0] and (V, D) not in made[1]
    reference = nn.Embedding(V, D).double()  # float64: the module's own backward, accumulated by autograd
    reference.weight.data.copy_(start.double())
    _two_micro_batches(reference)
    torch.testing.assert_close(embedding.weight.grad, reference.weight.grad.float(), rtol=1e-6, atol=1e-6)

    # Negative control: without the in-place path the second backward makes its [V, D] gradient.
    monkeypatch.setattr(module, "grad_accumulates_in_place", lambda weight, group=None: False)
    plain = nn.Embedding(V, D)
    plain.weight.data.copy_(start)
    assert (V, D) in _two_micro_batches(plain)[1]
    torch.testing.assert_close(plain.weight.grad, embedding.weight.grad, rtol=1e-6, atol=1e-6)


def test_a_hooked_embedding_keeps_the_module_call():
    """FSDP and tensor parallelism hook the module: the plain module call runs (its hooks fire)."""
    embedding = nn.Embedding(10, 4)
    calls = []
    embedding.register_forward_hook(lambda *_: calls.append(1))
    embed(embedding, torch.tensor([[1, 2]])).sum().backward()
    assert calls == [1] and embedding.weight.grad is not None
