"""Packed sequences (titanrl/models/packed_sequences.py): one row of several sequences end to
end, attention kept inside each, gives each token what the right-padded batch gives it."""

from __future__ import annotations

import pytest
import torch

from titanrl.models.packed_sequences import (
    PackedSequences,
    packed_attention,
    packed_attention_layout,
    varlen_flash_attention,
)
from titanrl.models.qwen3 import CausalSDPA, Qwen3ForCausalLM
from titanrl.models.tiny import tiny_config

LENGTHS = [5, 9, 1, 3]


def test_layout_of_lengths() -> None:
    layout = PackedSequences.from_lengths([3, 1, 2])
    assert layout.sequence_of_token.tolist() == [0, 0, 0, 1, 2, 2]
    assert layout.position_of_token.tolist() == [0, 1, 2, 0, 0, 1]
    assert layout.cu_seqlens.tolist() == [0, 3, 4, 6] and layout.cu_seqlens.dtype == torch.int32
    assert layout.max_len == 3 and layout.num_sequences == 3
    with pytest.raises(ValueError, match="at least one token"):
        PackedSequences.from_lengths([2, 0])


def _model(batch_invariant: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config())
    model.init_weights(seed=0)
    return model.set_batch_invariant(batch_invariant)


def _padded_and_packed(model: Qwen3ForCausalLM, use_layout: bool = True):
    """The padded forward's hidden states at the real tokens, and the packed row's, with the
    gradient of a weighted sum of each wrt every parameter."""
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]
    weights = torch.randn(sum(LENGTHS), model.config.hidden_size, generator=gen)
    padded = torch.zeros(len(seqs), max(LENGTHS), dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
    layout = PackedSequences.from_lengths(LENGTHS)
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        if packed:
            ids, pos = torch.cat(seqs)[None], layout.position_of_token[None]
            if use_layout:
                with packed_attention_layout(model, layout):
                    hidden = model.hidden_states(ids, pos)[0]
            else:
                hidden = model.hidden_states(ids, pos)[0]
        else:
            hidden = model.hidden_states(padded)[layout.sequence_of_token, layout.position_of_token]
        (hidden * weights).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_packed_forward_and_gradients_equal_padded(batch_invariant: bool) -> None:
    (h_pad, g_pad), (h_pack, g_pack) = _padded_and_packed(_model(batch_invariant))
    if batch_invariant:  # the batch-invariant kernels give a token the same bits either way
        assert torch.equal(h_pack, h_pad)
    else:
        torch.testing.assert_close(h_pack, h_pad, rtol=1e-5, atol=1e-6)
    for name in g_pad:
        torch.testing.assert_close(g_pack[name], g_pad[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_the_layout_sequences_attend_to_each_other() -> None:
    """Negative control: the same packed row read as one long sequence differs (its later
    sequences attend to the earlier ones)."""
    (h_pad, _), (h_pack, _) = _padded_and_packed(_model(False), use_layout=False)
    first = LENGTHS[0]
    torch.testing.assert_close(h_pack[:first], h_pad[:first], rtol=1e-5, atol=1e-6)  # nothing before it
    assert (h_pack[first:] - h_pad[first:]).abs().max() > 1e-2


def test_layout_is_unset_after_the_block_and_needs_a_backend() -> None:
    model = _model(False)
    with packed_attention_layout(model, PackedSequences.from_lengths([2])):
        assert all(m.packed is not None for m in model.modules() if isinstance(m, CausalSDPA))
    assert all(m.packed is None for m in model.modules() if isinstance(m, CausalSDPA))
    with pytest.raises(TypeError, match="no attention backend"):
        with packed_attention_layout(torch.nn.Linear(2, 2), PackedSequences.from_lengths([2])):
            pass


def test_varlen_kernel_is_declined_off_cuda() -> None:
    q = torch.randn(1, 4, 2, 32)
    assert varlen_flash_attention(q, q, q, PackedSequences.from_lengths([4]), 0.1) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's varlen flash kernel)")
def test_varlen_flash_kernel_matches_padded_attention_on_cuda() -> None:
    layout = PackedSequences.from_lengths(LENGTHS, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, sum(LENGTHS), 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, sum(LENGTHS), 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
    backend = CausalSDPA(4, 2, 64)
    fast = varlen_flash_attention(q, k, v, layout, backend.scale)
    assert fast is not None, "torch's varlen kernel did not run on CUDA"
    reference = packed_attention(backend._padded, q, k, v, layout)
    torch.testing.assert_close(fast.float(), reference.float(), rtol=2e-2, atol=2e-2)


def _shared_prefix_attention(share: bool):
    """Two sequences that start with the same 4 tokens: the packed row holds the prefix once
    (sequence 1 keeps only its 3 own tokens), and attention of each own token must equal that of
    the sequence laid out in full. Returns (expected, packed output) at the packed tokens."""
    gen = torch.Generator().manual_seed(2)
    H, K, D = 4, 2, 8
    prefix, tails = 4, [2, 3]
    full = [torch.randn(prefix + n, 3, H, D, generator=gen) for n in tails]
    full[1][:prefix] = full[0][:prefix]  # the shared prompt: same q/k/v (same hidden states)
    sdpa = CausalSDPA(H, K, D)

    def attend(q, k, v):
        return sdpa._padded(q, k[:, :, :K], v[:, :, :K])

    expected = [attend(*(s[None, :, i] for i in range(3)))[0] for s in full]
    packed_tokens = torch.cat([full[0], full[1][prefix:]])[None]  # [1, N, 3, H, D]
    layout = PackedSequences(
        sequence_of_token=torch.tensor([0] * (prefix + tails[0]) + [1] * tails[1]),
        position_of_token=torch.tensor(list(range(prefix + tails[0])) + list(range(prefix, prefix + tails[1]))),
        cu_seqlens=torch.tensor([0, prefix + tails[0], prefix + sum(tails)], dtype=torch.int32),
        max_len=prefix + max(tails),
        shared_token_E=torch.arange(prefix) if share else None,
        shared_sequence_E=torch.ones(prefix, dtype=torch.long) if share else None,
        shared_position_E=torch.arange(prefix) if share else None)
    q, k, v = (packed_tokens[:, :, i] for i in range(3))
    out = packed_attention(attend, q, k[:, :, :K], v[:, :, :K], layout)[0]
    return torch.cat([expected[0], expected[1][prefix:]]), out


def test_shared_prefix_keys_reach_the_sequences_that_share_them() -> None:
    expected, out = _shared_prefix_attention(share=True)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # Negative control: without the prefix's copies, sequence 1's own tokens see no prompt.
    expected, out = _shared_prefix_attention(share=False)
    assert torch.equal(out[:6], expected[:6]) and not torch.allclose(out[6:], expected[6:], atol=1e-3)
