"""Chunked LM head + logprobs (trainer/chunked_logprobs.py): the unchunked path's values and
gradients, bitwise in batch-invariant mode, without ever saving full-vocabulary logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titanrl import kernels
from titanrl.config import ModelConfig
from titanrl.trainer.chunked_logprobs import chunked_token_logprobs
from titanrl.trainer.grpo import clipped_surrogate_loss, token_logprobs
from support.layout_check import make_case
from support.new_tensors import ShapesMade
from titanrl.trainer.step import trimmed_len
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup

N, D, V = 30, 16, 50


def _inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen, dtype=dtype)
    weight = torch.randn(V, D, generator=gen, dtype=dtype) * 0.5
    targets = torch.randint(0, V, (N,), generator=gen)
    # Upstream gradients of the logprob and the entropy output (a loss and an entropy bonus).
    g_lp, g_ent = torch.randn(N, generator=gen, dtype=dtype), torch.randn(N, generator=gen, dtype=dtype)
    return hidden, weight, targets, g_lp, g_ent


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def _grads(fn, hidden, weight, g_lp, g_ent):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(h, w)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 7, 10, N, 4 * N])
def test_values_and_gradients_equal_unchunked(dtype, chunk):
    """Logprobs, entropies and the gradients of hidden states and head weight (from both outputs)
    equal the unchunked path's (full logits, grpo.token_logprobs, direct entropy) to a relative L2
    of 1e-6 in float32 (1e-12 in float64), for chunk sizes that do (1, 10, N) and do not (7, 4N)
    divide N, at temperature 0.7."""
    hidden, weight, targets, g_lp, g_ent = _inputs(dtype)
    T = 0.7

    def unchunked(h, w):
        logits = h @ w.t()
        if dtype == torch.float32:
            return token_logprobs(logits, targets, T), _entropy(logits, T)
        # grpo.token_logprobs computes in float32: the same formula in float64.
        logp = torch.log_softmax(logits / T, -1)
        return logp.gather(-1, targets[:, None]).squeeze(-1), _entropy(logits, T)

    def chunked(h, w):
        return chunked_token_logprobs(h, w, targets, T, chunk)

    want, got = _grads(unchunked, hidden, weight, g_lp, g_ent), _grads(chunked, hidden, weight, g_lp, g_ent)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        assert _rel(a, b) <= tol, (name, _rel(a, b))


def test_entropy_equals_categorical_entropy():
    """The entropy output is the sampling distribution's: Categorical(logits / T).entropy() (float64)."""
    hidden, weight, targets, _, _ = _inputs(torch.float64)
    _, ent = chunked_token_logprobs(hidden, weight, targets, 1.3, 4)
    want = torch.distributions.Categorical(logits=hidden @ weight.t() / 1.3).entropy()
    assert torch.allclose(ent, want, atol=1e-12, rtol=0)
    assert (ent > 0.5).all()  # a real distribution, not a degenerate one


def test_only_the_entropy_output_used():
    """A loss on the entropy alone (an entropy bonus) gets the direct computation's gradients."""
    hidden, weight, targets, _, g_ent = _inputs(torch.float64)
    zero = torch.zeros(N, dtype=torch.float64)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (chunked_token_logprobs(h, w, targets, 0.9, 8)[1] * g_ent).sum().backward()
    _, _, h_ref, w_ref = _grads(lambda a, b: (zero, _entropy(a @ b.t(), 0.9)), hidden, weight, zero, g_ent)
    assert torch.allclose(h.grad, h_ref, atol=1e-12) and torch.allclose(w.grad, w_ref, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 5, 16, N])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batch_invariant_bitwise_equal_unchunked(chunk, temperature):
    """In batch-invariant mode the chunked logprobs are torch.equal to the unchunked batch-invariant
    path (`kernels.linear` on all rows, then `kernels.token_logprobs`), whatever the chunk size."""
    hidden, weight, targets, _, _ = _inputs(torch.float32, seed=1)
    want = kernels.token_logprobs(kernels.linear(hidden, weight), targets, temperature)
    got, _ = chunked_token_logprobs(hidden, weight, targets, temperature, chunk, batch_invariant=True)
    assert torch.equal(got, want)


def test_bad_arguments_are_refused():
    hidden, weight, targets, _, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, weight, targets, 1.0, 0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight, targets, 0.0, 4)


# ----------------------------------------------------------------------------- in the trainer


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("chunked"), tied=True)


def _trainer(case, chunk: int, micro_batch_size: int = 3, temperature: float = 0.8) -> GRPOTrainer:
    train = dataclasses.replace(
        case.train,
        memory=dataclasses.replace(case.train.memory, logprob_chunk_tokens=chunk, micro_batch_size=micro_batch_size),
    )
    return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=case.checkpoint), train, temperature, seed=0))


def _step_grads(trainer: GRPOTrainer, batch):
    stats = trainer.accumulate_gradients(batch)
    return stats, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_trainer_gradients_do_not_depend_on_chunk_size(case):
    """A GRPOTrainer gradient pass with 5-token chunks (not dividing any micro-batch) gives the loss,
    entropy sum and gradients of one with a chunk covering every token (1e-6), and those equal a
    hand-written unchunked step (full logits, grpo.token_logprobs, one micro-batch) to 1e-6."""
    small, small_grads = _step_grads(_trainer(case, 5), case.batch)
    whole, whole_grads = _step_grads(_trainer(case, 10**6), case.batch)
    assert abs(small.loss_sum - whole.loss_sum) <= 1e-6 * abs(whole.loss_sum)
    assert abs(small.entropy_sum - whole.entropy_sum) <= 1e-6 * whole.entropy_sum
    for n in whole_grads:
        assert (small_grads[n] - whole_grads[n]).abs().max().item() <= 1e-6, n

    # The unchunked reference: the model's full logits, one micro-batch of every row.
    trainer = _trainer(case, 10**6, micro_batch_size=64)
    b = case.batch
    T = trimmed_len(b.loss_mask_BT)
    logits = trainer.model(b.input_ids_BT[:, :T])
    lp = token_logprobs(logits, b.targets_BT[:, :T], trainer.temperature)
    loss_sum, _ = clipped_surrogate_loss(lp, b.old_logprobs_BT[:, :T], b.advantages_B, b.loss_mask_BT[:, :T],
                                         case.train.loss.clip_eps)
    (loss_sum / b.loss_mask_BT.sum()).backward()
    for n, p in trainer.model.named_parameters():
        assert (small_grads[n] - p.grad).abs().max().item() <= 1e-6, n
    # The entropy the step reports is the direct one over the trained tokens.
    with torch.no_grad():
        direct = (_entropy(logits.detach(), trainer.temperature) * b.loss_mask_BT[:, :T]).sum().item()
    assert small.entropy_sum == pytest.approx(direct, rel=1e-6) and direct > 0


def _vocab_sized_saves(fn, vocab: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves while `fn` runs whose last dimension is the vocabulary."""
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[-1] == vocab:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_saved_tensor_holds_more_than_a_chunk_of_logits(case):
    """Structural memory check: during a GRPOTrainer gradient pass, autograd saves no tensor with a
    vocabulary-sized last dimension (no logits at all: the chunked Function saves hidden states,
    weight and per-token numbers). Negative control: the unchunked path (full logits through
    grpo.token_logprobs) saves [rows, T, V] tensors, which the same check sees."""
    chunk = 4
    trainer = _trainer(case, chunk)
    vocab = trainer.pm.config.vocab_size
    assert vocab != trainer.pm.config.hidden_size  # the head weight [V, D] must not look like logits
    saved = _vocab_sized_saves(lambda: trainer.accumulate_gradients(case.batch), vocab)
    assert all(torch.Size(s).numel() // vocab <= chunk for s in saved), saved

    b = case.batch
    unchunked = _vocab_sized_saves(
        lambda: token_logprobs(trainer.model(b.input_ids_BT), b.targets_BT, 0.8).sum().backward(), vocab)
    assert max(torch.Size(s).numel() // vocab for s in unchunked) >= b.input_ids_BT.numel() > chunk


def _two_micro_batches(weight: torch.nn.Parameter) -> list[list[tuple[int, ...]]]:
    """Backward of two micro-batches into `weight.grad`; the shapes each backward made."""
    gen = torch.Generator().manual_seed(3)
    made = []
    for _ in range(2):
        hidden = torch.randn(24, weight.shape[1], generator=gen).to(weight.dtype)
        targets = torch.randint(weight.shape[0], (24,), generator=gen)
        logprobs, entropy = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=8)
        loss = logprobs.sum() + 0.1 * entropy.sum()
        with ShapesMade() as mode:
            loss.backward()
        made.append(mode.shapes)
    return made


def test_a_later_micro_batch_adds_the_head_gradient_in_place(monkeypatch):
    """The second micro-batch's head gradient goes straight into weight.grad: no [V, D] tensor is
    made in its backward, and the accumulated gradient equals float64's sum of both."""
    import titanrl.trainer.chunked_logprobs as module

    V, D = 1000, 16
    start = torch.randn(V, D, generator=torch.Generator().manual_seed(0)) * 0.1
    weight = torch.nn.Parameter(start.clone())
    made = _two_micro_batches(weight)
    assert (V, D) in made[0]  # the first micro-batch's gradient is a fresh tensor (there is no .grad yet)
    assert (V, D) not in made[1]
    reference = torch.nn.Parameter(start.double())  # float64: never in place, the returned gradients summed
    _two_micro_batches(reference)
    torch.testing.assert_close(weight.grad, reference.grad.float(), rtol=1e-5, atol=1e-6)

    # Negative control: without the in-place path the second backward makes its [V, D] gradient.
    monkeypatch.setattr(module, "grad_accumulates_in_place", lambda weight, group=None: False)
    plain = torch.nn.Parameter(start.clone())
    assert (V, D) in _two_micro_batches(plain)[1]
    torch.testing.assert_close(plain.grad, weight.grad, rtol=1e-6, atol=1e-7)
