"""Batch-invariant CPU kernels (titanrl.kernels, torch backend): bitwise invariance and gradients.

Invariance claims are checked with `torch.equal` only: a row (token, query) computed alone
must give exactly the bits it gets inside batches of other sizes, at other positions, and
(attention) in a full forward, a prefill, a chunked prefill or a decode step. Gradients are
compared with autograd through plain torch reference ops, and with `gradcheck` in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanrl import kernels
from support import kernel_checks as checks
from titanrl.kernels.cpu_attention import KeyTable, attention, varlen_attention
from titanrl.kernels.rotary import apply_rotary
from titanrl.kernels.swiglu import silu_gate
from titanrl.kernels.torch_linear import linear
from titanrl.kernels.torch_logprobs import log_softmax, token_logprobs
from titanrl.kernels.torch_rms_norm import rms_norm
from titanrl.models import qwen3
from titanrl.trainer import grpo

BATCH_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 31, 33, 64, 65, 130]
"""Row counts around MKL's class boundaries (AVX2: 1, 2-3, >= 4; AVX-512 without MKL's strict mode:
up to 15 rows in the small-M class) and thread-split points."""


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Runs the test with 1 and with 2 intra-op threads (MKL splits rows across threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _rows_invariant(fn, row: torch.Tensor, width: int, gen: torch.Generator, sizes=BATCH_SIZES) -> list[tuple]:
    """(M, pos) pairs where fn(batch)[pos] differs from fn(row alone); empty means invariant."""
    alone = fn(row[None])[0]
    bad = []
    for M in sizes:
        for pos in {0, M - 1, int(torch.randint(M, (1,), generator=gen))}:
            batch = torch.randn(M, width, generator=gen) * row.abs().max()
            batch[pos] = row
            if not torch.equal(fn(batch)[pos], alone):
                bad.append((M, pos))
    return bad


# ----------------------------------------------------------------------------------- linear

LINEAR_SHAPES = [
    (128, 128), (512, 512), (1536, 1536), (128, 384), (384, 128), (512, 1536), (5, 5), (129, 7), (37, 53), (128, 1)
]


@pytest.mark.parametrize("K,N", LINEAR_SHAPES)
def test_linear_row_bits_independent_of_batch(K, N, threads):
    """A row of `linear` has the same bits alone and inside batches of 1..64 rows at any
    position, including shapes (N < 16, odd K) where padding rows alone is not enough."""
    gen = torch.Generator().manual_seed(K * 1000 + N)
    W = torch.randn(N, K, generator=gen) * K**-0.5
    x = torch.randn(K, generator=gen)
    assert _rows_invariant(lambda A: linear(A, W), x, K, gen) == []


def test_linear_check_detects_library_variance():
    """The invariance harness is not vacuous: plain `F.linear` fails it on this CPU (M = 1 vs
    larger M give different bits), while `linear` passes on the same inputs. (Under MKL's strict
    AVX2 mode, which this session runs in on AVX-512 CPUs, F.linear itself may pass: then it skips,
    and tests/test_mkl_mode.py's negative control shows the check failing without that mode.)"""
    gen = torch.Generator().manual_seed(0)
    W, x = torch.randn(512, 512, generator=gen) * 512**-0.5, torch.randn(512, generator=gen)
    if _rows_invariant(lambda A: F.linear(A, W), x, 512, gen) == []:
        pytest.skip("this machine's BLAS happens to be batch-invariant for F.linear")
    assert _rows_invariant(lambda A: linear(A, W), x, 512, gen) == []


@pytest.mark.parametrize("K,N", [(128, 384), (384, 128), (129, 7), (5, 5)])
def test_linear_input_gradient_rows_independent_of_batch(K, N, threads):
    """dL/dx for one row (same upstream gradient row) has the same bits alone and in batches."""
    gen = torch.Generator().manual_seed(K + N)
    W = torch.randn(N, K, generator=gen) * K**-0.5
    g = torch.randn(N, generator=gen)

    def grad_x(G: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(G.shape[0], K, requires_grad=True)
        linear(x, W).backward(G)
        return x.grad

    assert _rows_invariant(grad_x, g, N, gen) == []


def test_linear_leading_dims_and_bias():
    """Any leading shape works; a token's row is the same in [B, T, K] as alone; bias is added."""
    gen = torch.Generator().manual_seed(1)
    W, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(3, 11, 64, generator=gen)
    y = linear(x, W, b)
    assert y.shape == (3, 11, 96)
    assert torch.equal(y[2, 5], linear(x[2, 5], W, b))
    torch.testing.assert_close(y, F.linear(x, W, b), rtol=1e-5, atol=1e-5)


def test_linear_gradients_match_autograd():
    """Gradients (x, W, bias) equal autograd through F.linear to <= 1e-5 (float32, odd sizes
    that take the padding paths), and pass gradcheck in float64."""
    gen = torch.Generator().manual_seed(2)
    for M, K, N in [(1, 32, 24), (3, 37, 5), (10, 64, 130)]:
        x, W, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
        G = torch.randn(M, N, generator=gen)
        a = [t.clone().requires_grad_(True) for t in (x, W, b)]
        r = [t.clone().requires_grad_(True) for t in (x, W, b)]
        linear(*a).backward(G)
        F.linear(*r).backward(G)
        for ta, tr in zip(a, r):
            assert (ta.grad - tr.grad).abs().max() <= 1e-5
    args = [torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_(True) for s in [(3, 7), (5, 7), (5,)]]
    assert torch.autograd.gradcheck(linear, args)


def test_linear_rejects_bad_shapes():
    """Mismatched weight or bias shapes raise a ValueError naming the field."""
    with pytest.raises(ValueError, match="weight.shape"):
        linear(torch.zeros(2, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="bias"):
        linear(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(5))


# ---------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("D", [32, 64, 128, 512, 37])
def test_rms_norm_row_bits_independent_of_batch(D, threads):
    """A row of `rms_norm` has the same bits alone and in batches of 1..64 rows at any position."""
    gen = torch.Generator().manual_seed(D)
    w = torch.randn(D, generator=gen)
    assert _rows_invariant(lambda A: rms_norm(A, w, 1e-6), torch.randn(D, generator=gen) * 3, D, gen) == []


def test_rms_norm_equals_model_norm_bitwise():
    """`rms_norm` returns exactly the bits of qwen3.RMSNorm (hidden and per-head q/k layouts),
    so switching the model to it changes nothing in the default (float32) arithmetic."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(4, 9, 128), (2, 7, 4, 32)]:
        norm = qwen3.RMSNorm(shape[-1], 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1], generator=gen))
        x = torch.randn(*shape, generator=gen)
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))


def test_rms_norm_gradients_match_autograd():
    """Gradients equal autograd through qwen3.RMSNorm's ops to <= 1e-5; gradcheck in float64."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(6, 48, generator=gen), torch.randn(48, generator=gen)
    G = torch.randn(6, 48, generator=gen)
    a = [t.clone().requires_grad_(True) for t in (x, w)]
    r = [t.clone().requires_grad_(True) for t in (x, w)]
    rms_norm(a[0], a[1], 1e-6).backward(G)
    (r[1] * (r[0] * torch.rsqrt(r[0].pow(2).mean(-1, keepdim=True) + 1e-6))).backward(G)
    for ta, tr in zip(a, r):
        assert (ta.grad - tr.grad).abs().max() <= 1e-5
    args = [torch.randn(s, dtype=torch.float64, generator=gen).requires_grad_(True) for s in [(3, 8), (8,)]]
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), args)


# --------------------------------------------------------------------------------- silu_gate


@pytest.mark.parametrize("width", [5, 37, 384, 1536])
def test_silu_gate_row_bits_independent_of_batch(width, threads):
    """A row of `silu_gate(g, u)` has the same bits alone and in batches of 1..64 rows."""
    gen = torch.Generator().manual_seed(width)
    gu = torch.cat([torch.randn(width, generator=gen) * 4, torch.randn(width, generator=gen)])
    # Each batch row holds [gate | up]; the op sees them as two [M, width] tensors.
    assert _rows_invariant(lambda A: silu_gate(A[:, :width], A[:, width:]), gu, 2 * width, gen) == []


def test_silu_gate_fixes_torch_silu_tail_variance():
    """Why silu_gate exists: torch's F.silu gives elements in the last `numel % 32` of a
    tensor different bits (scalar tail loop) for some inputs, so a row's bits change with the
    batch; silu_gate gives every element the same bits as in the full tensor."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=gen) * 6
    one = torch.ones(4096)
    full_lib, full_ours = F.silu(x), silu_gate(x, one)
    lib_bad = sum(not torch.equal(F.silu(x[:n]), full_lib[:n]) for n in range(1, 300))
    ours_bad = sum(not torch.equal(silu_gate(x[:n], one[:n]), full_ours[:n]) for n in range(1, 300))
    assert ours_bad == 0
    assert lib_bad > 0, "torch's silu became tail-invariant: silu_gate could use F.silu"
    torch.testing.assert_close(full_ours, full_lib, rtol=2e-6, atol=1e-7)


def test_silu_gate_gradients_match_autograd():
    """Gradients equal autograd through F.silu(g) * u to <= 1e-5, stay finite at |g| = 100,
    and pass gradcheck in float64."""
    gen = torch.Generator().manual_seed(6)
    g = torch.cat([torch.randn(500, generator=gen) * 5, torch.tensor([-100.0, 100.0, 0.0])])
    u = torch.randn(g.shape, generator=gen)
    G = torch.randn(g.shape, generator=gen)
    a = [t.clone().requires_grad_(True) for t in (g, u)]
    r = [t.clone().requires_grad_(True) for t in (g, u)]
    out = silu_gate(*a)
    assert torch.equal(out, silu_gate(g, u))  # autograd path: same forward bits as inference
    out.backward(G)
    (F.silu(r[0]) * r[1]).backward(G)
    for ta, tr in zip(a, r):
        assert torch.isfinite(ta.grad).all()
        assert (ta.grad - tr.grad).abs().max() <= 1e-5
    args = [torch.randn(4, 6, dtype=torch.float64, generator=gen).requires_grad_(True) for _ in range(2)]
    assert torch.autograd.gradcheck(silu_gate, args)


# ---------------------------------------------------------------------------------- rotary


def test_apply_rotary_equals_model_and_is_per_token():
    """`apply_rotary` equals qwen3.apply_rotary bitwise on [B, T, H, D]; a token's result is
    the same in the flat [N, H, D] layout (vLLM's) as in the padded batch."""
    gen = torch.Generator().manual_seed(7)
    rope = qwen3.RotaryEmbedding(32, 1e6)
    x = torch.randn(3, 10, 4, 32, generator=gen)
    pos = torch.arange(10).expand(3, 10)
    cos, sin = rope(pos, torch.float32)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out, qwen3.apply_rotary(x, cos, sin))
    flat = apply_rotary(x[1, 3:7], cos[1, 3:7], sin[1, 3:7])
    assert torch.equal(flat, out[1, 3:7])
    assert torch.equal(apply_rotary(x[2, 9:10], cos[2, 9:10], sin[2, 9:10])[0], out[2, 9])


def test_apply_rotary_gradients_match_autograd_and_rejects_bad_shapes():
    """Gradients equal autograd through the model's rotary to <= 1e-5 and pass gradcheck in
    float64; mismatched cos/sin raise."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 3, 16, generator=gen)
    cos, sin = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    G = torch.randn(2, 5, 3, 16, generator=gen)
    a, r = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    apply_rotary(a, cos, sin).backward(G)
    qwen3.apply_rotary(r, cos, sin).backward(G)
    assert (a.grad - r.grad).abs().max() <= 1e-5
    x64 = torch.randn(1, 3, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    c64, s64 = torch.randn(1, 3, 8, dtype=torch.float64, generator=gen), torch.randn(1, 3, 8, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, c64, s64), [x64])
    with pytest.raises(ValueError, match="cos"):
        apply_rotary(x, cos[:, :4], sin)


# ------------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("V", [100, 512, 4099])
def test_token_logprobs_rows_independent_of_batch_and_equal_trainer(V, threads):
    """A row's log_softmax and token logprob have the same bits alone and in batches of 1..64,
    and `token_logprobs` is bitwise `titanrl.trainer.grpo.token_logprobs` (temperatures 1, 0.7)."""
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(V, generator=gen) * 4
    for temp in (1.0, 0.7):
        assert _rows_invariant(lambda A: log_softmax(A, temp), x, V, gen) == []
        logits = torch.randn(3, 9, V, generator=gen) * 4
        targets = torch.randint(V, (3, 9), generator=gen)
        assert torch.equal(token_logprobs(logits, targets, temp), grpo.token_logprobs(logits, targets, temp))
    res = checks.check_log_softmax(log_softmax, token_logprobs, "cpu", V, BATCH_SIZES, tol=1e-5)
    assert res["ok"], res


def test_logprob_gradients_match_autograd():
    """Gradients of log_softmax and token_logprobs match autograd through the reference ops
    to <= 1e-5 (float32) and pass gradcheck (float64)."""
    res = checks.check_gradients({"log_softmax": log_softmax, "token_logprobs": token_logprobs}, "cpu")
    assert res["ok"], res
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    t = torch.randint(11, (3,), generator=gen)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, t, 0.7), [x])
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 32), (4, 4, 64), (6, 1, 24)])
def test_attention_prefill_chunked_decode_and_full_forward_identical(Hq, Hkv, D, threads):
    """Every query gets the same bits in a full causal forward over a right-padded batch of
    mixed lengths, a prefill of its sequence alone, chunked prefill (chunk sizes 1, 5, 16,
    64, 70), decode over a cache (alone and batched with other lengths); GQA included, and the
    output matches float64 attention to 1e-5."""
    res = checks.check_attention(
        attention, "cpu", torch.float32, lengths=[150, 3, 64, 97], Hq=Hq, Hkv=Hkv, D=D,
        chunk_sizes=[1, 5, 16, 64, 70], n_decode=4, tol=1e-5, seed=Hq * 100 + D,
    )
    assert res["ok"], res


def test_attention_bits_independent_of_batch_companions():
    """A sequence's outputs are bitwise the same alone and inside batches of 2..9 sequences of
    other lengths at any slot, with or without kv_lens masking of the padding."""
    gen = torch.Generator().manual_seed(10)
    L, H, Hkv, D = 45, 4, 2, 32
    q, k, v = (torch.randn(1, L, h, D, generator=gen) for h in (H, Hkv, Hkv))
    alone = attention(q, k, v)
    for B in [2, 5, 9]:
        T = 80
        pos = int(torch.randint(B, (1,), generator=gen))
        Q, K, V = (torch.randn(B, T, h, D, generator=gen) for h in (H, Hkv, Hkv))
        Q[pos, :L], K[pos, :L], V[pos, :L] = q[0], k[0], v[0]
        lens = torch.randint(1, T + 1, (B,), generator=gen)
        lens[pos] = L
        assert torch.equal(attention(Q, K, V)[pos, :L], alone[0])
        assert torch.equal(attention(Q, K, V, kv_lens=lens)[pos, :L], alone[0])


def test_attention_heads_first_cache_same_bits_without_copy():
    """A heads-first [B, Hkv, L, D] cache (read in place through its strides) gives the same
    bits as the [B, L, Hkv, D] layout, for decode and chunked prefill."""
    gen = torch.Generator().manual_seed(12)
    B, L, H, Hkv, D = 3, 128, 4, 2, 32
    k, v = torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    lens = torch.tensor([128, 70, 1])
    q = torch.randn(B, 1, H, D, generator=gen)
    want = attention(q, k, v, q_start=lens - 1, kv_lens=lens)
    assert torch.equal(attention(q, kf, vf, q_start=lens - 1, kv_lens=lens, heads_first=True), want)
    qc = torch.randn(B, 9, H, D, generator=gen)
    want = attention(qc, k, v, q_start=40, kv_lens=49)
    assert torch.equal(attention(qc, kf, vf, q_start=40, kv_lens=49, heads_first=True), want)


def test_attention_reads_a_paged_cache_in_place_with_the_dense_bits():
    """Keys scattered over a paged cache (vLLM's token-major layout written by `write_kv`,
    shuffled block ids, block size 16) read in place by `varlen_attention` give every query
    of a mixed decode/chunk/prefill step exactly the bits of the dense training forward."""
    from titanrl.rollout.vllm.paged_attention import cache_key_table, write_kv

    gen = torch.Generator().manual_seed(13)
    lens, query_lens, Hq, Hkv, D, bs = [37, 5, 70], [1, 5, 23], 4, 2, 32, 16
    B, T = len(lens), max(lens)
    q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    full = attention(q, k, v)
    blocks_per_seq = -(-T // bs)
    kv = torch.full((B * blocks_per_seq + 3, Hkv, bs, 2 * D), float("nan"))  # unwritten slots are never read
    table = torch.randperm(kv.shape[0], generator=gen)[: B * blocks_per_seq].view(B, blocks_per_seq)
    for b, L in enumerate(lens):
        slots = table[b, torch.arange(L) // bs] * bs + torch.arange(L) % bs
        write_kv(kv, k[b, :L], v[b, :L], slots)
    # One step: sequence b's last query_lens[b] tokens, flattened in request order.
    q_NHD = torch.cat([q[b, L - n : L] for b, (L, n) in enumerate(zip(lens, query_lens))])
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    seq_lens = torch.tensor(lens)
    out, _ = varlen_attention(q_NHD, cache_key_table(kv, table), Hkv, starts, seq_lens - torch.tensor(query_lens),
                              seq_lens, D**-0.5)
    want = torch.cat([full[b, L - n : L] for b, (L, n) in enumerate(zip(lens, query_lens))])
    assert torch.equal(out, want)


@pytest.mark.parametrize("D", [8, 24, 40, 64, 128])
def test_attention_vector_path_has_the_plain_loops_bits(D):
    """The kernel's float fast path (8-lane vectors, 4 keys or 64 value columns per pass) gives
    exactly the bits of its plain scalar loops, outputs and log-sum-exps, for head dims that
    take it (multiples of 8, one or several 64-column passes) and ones that do not."""
    gen = torch.Generator().manual_seed(D)
    B, T, Hq, Hkv = 3, 77, 4, 2
    q = torch.randn(B * T, Hq, D, generator=gen)
    k, v = torch.randn(B, T, Hkv, D, generator=gen), torch.randn(B, T, Hkv, D, generator=gen)
    args = (q, KeyTable.dense(k, v, heads_first=False), Hkv, torch.arange(B + 1) * T, torch.tensor([0, 5, 0]),
            torch.tensor([T, T - 9, 1]), D**-0.5)
    fast, fast_lse = varlen_attention(*args, with_lse=True)
    plain, plain_lse = varlen_attention(*args, with_lse=True, plain_loops=True)
    assert torch.equal(fast, plain) and torch.equal(fast_lse, plain_lse)


def test_varlen_attention_refuses_mismatched_request_tables():
    """The kernel trusts its pointers, so request tables that do not match q or out are refused
    before it runs, with the shapes named."""
    q, k = torch.zeros(6, 2, 16), torch.zeros(2, 4, 1, 16)
    src = KeyTable.dense(k, k, heads_first=False)
    ok = dict(query_start=torch.tensor([0, 3, 6]), first_pos=torch.tensor([0, 1]), kv_len=torch.tensor([4, 4]))
    varlen_attention(q, src, 1, scale=0.25, **ok)
    with pytest.raises(ValueError, match="query_start"):
        varlen_attention(q, src, 1, scale=0.25, **{**ok, "query_start": torch.tensor([0, 6])})
    with pytest.raises(ValueError, match="ends at 7"):
        varlen_attention(q, src, 1, scale=0.25, **{**ok, "query_start": torch.tensor([0, 3, 7])})
    with pytest.raises(ValueError, match="out must be"):
        varlen_attention(q, src, 1, scale=0.25, out=torch.zeros(5, 2, 16), **ok)


def test_attention_gradients_match_autograd():
    """Gradients w.r.t. q, k, v equal autograd through float64 reference attention to <= 1e-5
    (GQA, chunk offset, kv_lens), and pass gradcheck in float64."""
    res = checks.check_gradients({"attention": attention}, "cpu")
    assert res["ok"], res
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 5, 4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 9, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 9, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    starts, lens = torch.tensor([4, 2]), torch.tensor([9, 7])
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, q_start=starts, kv_lens=lens), [q, k, v]
    )


def test_attention_rejects_bad_arguments():
    """Wrong head counts, shapes or kv_lens raise a ValueError naming the field."""
    q, k = torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention(q, k, k)
    with pytest.raises(ValueError, match="must both be"):
        attention(q[:, :, :2], k, k[:, :3])
    with pytest.raises(ValueError, match="kv_lens"):
        attention(q[:, :, :2], k, k, kv_lens=9)


# ------------------------------------------------------------------------- property tests


def test_property_linear_row_invariance():
    """Hypothesis: for random K, N, M and positions, a linear row's bits never depend on M/pos."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
    @hypothesis.given(K=st.integers(1, 300), N=st.integers(1, 300), M=st.integers(1, 80), seed=st.integers(0, 2**16))
    def prop(K, N, M, seed):
        gen = torch.Generator().manual_seed(seed)
        W, x = torch.randn(N, K, generator=gen), torch.randn(K, generator=gen)
        pos = int(torch.randint(M, (1,), generator=gen))
        A = torch.randn(M, K, generator=gen)
        A[pos] = x
        assert torch.equal(linear(A, W)[pos], linear(x[None], W)[0])

    prop()


def test_property_attention_any_chunking_equals_full_forward():
    """Hypothesis: splitting a sequence into arbitrary chunks (random cut points, GQA group
    sizes, head dims, thread counts) gives every query exactly the full forward's bits."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
    @hypothesis.given(
        L=st.integers(1, 90), groups=st.sampled_from([1, 2, 3]), D=st.sampled_from([8, 24, 32, 37, 64]),
        threads=st.sampled_from([1, 2]), cuts=st.lists(st.integers(1, 89), max_size=5), seed=st.integers(0, 2**16),
    )
    def prop(L, groups, D, threads, cuts, seed):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(1, L, 2 * groups, D, generator=gen)
        k, v = torch.randn(1, L, 2, D, generator=gen), torch.randn(1, L, 2, D, generator=gen)
        full = attention(q, k, v)
        edges = sorted({0, L, *[c for c in cuts if c < L]})
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            parts = [attention(q[:, s:e], k[:, :e], v[:, :e], q_start=s) for s, e in zip(edges, edges[1:])]
        finally:
            torch.set_num_threads(before)
        assert torch.equal(torch.cat(parts, dim=1), full)

    prop()


def test_dispatch_uses_torch_backend_on_cpu():
    """`backend` picks 'torch' for CPU tensors, and the package-level ops are the torch ones."""
    x = torch.randn(5, 16)
    W = torch.randn(8, 16)
    assert kernels.backend(x) == "torch"
    assert torch.equal(kernels.linear(x, W), linear(x, W))
    assert torch.equal(kernels.rms_norm(x, W[0], 1e-6), rms_norm(x, W[0], 1e-6))
    assert torch.equal(kernels.log_softmax(x, 0.5), log_softmax(x, 0.5))


def test_cpu_kernel_build_is_cached_and_names_a_missing_compiler(monkeypatch, tmp_path):
    """The C++ attention kernel builds once into $TITANRL_KERNEL_CACHE and is reused from
    there; without a compiler the error says what to install before anything is attempted."""
    from titanrl.kernels import cpu_build

    monkeypatch.setenv("TITANRL_KERNEL_CACHE", str(tmp_path))
    lib = cpu_build.load.__wrapped__("attention")  # past the per-process cache
    assert hasattr(lib, "titanrl_attention_forward_f32")
    (built,) = tmp_path.glob("attention-*.so")
    stamp = built.stat().st_mtime_ns
    cpu_build.load.__wrapped__("attention")
    assert list(tmp_path.glob("*")) == [built] and built.stat().st_mtime_ns == stamp
    monkeypatch.setenv("CXX", "no-such-compiler-titanrl")
    with pytest.raises(cpu_build.KernelBuildError, match="apt-get install g\\+\\+"):
        cpu_build.load.__wrapped__("attention")
