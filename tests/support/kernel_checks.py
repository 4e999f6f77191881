"""Correctness and batch-invariance checks shared by the tests and the GPU check script.

Each `check_*` runs one op of a backend namespace (`titanrl.kernels.torch_*` functions, or the
`titanrl.kernels.triton_*` ones) on a probe row placed at random positions inside batches of
several sizes, and returns a JSON-able dict:
- `invariant`: the probe row's output (and input gradient, where checked) is bitwise equal
  (`torch.equal`) in every batch to its output alone;
- `max_rel_err`: largest |out - reference| / max|reference| against float64 torch ops;
- `ok`: invariant and within `tol`.
They raise nothing on a mismatch (callers assert or print), so a script can run them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, gen: torch.Generator, device, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    denom = ref.abs().max().clamp_min(1e-30)
    return float(((out.double() - ref).abs().max() / denom).item())


def _with_row(batch: torch.Tensor, row: torch.Tensor, pos: int) -> torch.Tensor:
    batch = batch.clone()
    batch[pos] = row
    return batch


def check_linear(
    linear: Callable, device, dtype: torch.dtype, K: int, N: int, Ms: Sequence[int], tol: float, seed: int = 0
) -> dict[str, Any]:
    """Forward rows and input-gradient rows of `linear(x, W)` alone vs inside batches of Ms."""
    g = _gen(seed)
    W = _randn(N, K, gen=g, device=device, dtype=dtype, scale=K**-0.5)
    x, gy = _randn(K, gen=g, device=device, dtype=dtype), _randn(N, gen=g, device=device, dtype=dtype)

    def run(A: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        A = A.clone().requires_grad_(True)
        y = linear(A, W)
        y.backward(G)
        return y.detach(), A.grad

    y1, gx1 = run(x[None], gy[None])
    invariant, lib_invariant, err = True, True, 0.0
    lib1 = F.linear(x[None], W)[0]
    for M in Ms:
        pos = int(torch.randint(M, (1,), generator=g))
        A = _with_row(_randn(M, K, gen=g, device=device, dtype=dtype), x, pos)
        G = _with_row(_randn(M, N, gen=g, device=device, dtype=dtype), gy, pos)
        y, gx = run(A, G)
        invariant &= torch.equal(y[pos], y1[0]) and torch.equal(gx[pos], gx1[0])
        lib_invariant &= torch.equal(F.linear(A, W)[pos], lib1)
        err = max(err, _rel_err(y, A.double() @ W.double().t()), _rel_err(gx, G.double() @ W.double()))
    return dict(op="linear", dtype=str(dtype), K=K, N=N, Ms=list(Ms), invariant=invariant,
                library_invariant=lib_invariant, max_rel_err=err, ok=invariant and err <= tol)


def check_rms_norm(
    rms_norm: Callable, device, dtype: torch.dtype, D: int, Ms: Sequence[int], tol: float, seed: int = 0
) -> dict[str, Any]:
    """Rows of `rms_norm(x, w, eps)` alone vs inside batches of Ms, and against float64."""
    g = _gen(seed)
    w = _randn(D, gen=g, device=device, dtype=dtype, scale=0.1) + 1
    x = _randn(D, gen=g, device=device, dtype=dtype)
    y1 = rms_norm(x[None], w, 1e-6)[0]
    invariant, err = True, 0.0
    for M in Ms:
        pos = int(torch.randint(M, (1,), generator=g))
        A = _with_row(_randn(M, D, gen=g, device=device, dtype=dtype), x, pos)
        y = rms_norm(A, w, 1e-6)
        invariant &= torch.equal(y[pos], y1)
        a = A.double()
        err = max(err, _rel_err(y, w.double() * a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)))
    return dict(op="rms_norm", dtype=str(dtype), D=D, Ms=list(Ms), invariant=invariant, max_rel_err=err,
                ok=invariant and err <= tol)


def check_log_softmax(
    log_softmax: Callable, token_logprobs: Callable, device, V: int, Ms: Sequence[int], tol: float,
    temperature: float = 0.7, seed: int = 0,
) -> dict[str, Any]:
    """Rows of log_softmax / token_logprobs alone vs in batches; token_logprobs == gathered log_softmax."""
    g = _gen(seed)
    x = _randn(V, gen=g, device=device, scale=3.0)
    t = int(torch.randint(V, (1,), generator=g))
    ls1 = log_softmax(x[None], temperature)[0]
    tl1 = token_logprobs(x[None], torch.tensor([t], device=device), temperature)[0]
    invariant, gather_equal, err = True, True, 0.0
    for M in Ms:
        pos = int(torch.randint(M, (1,), generator=g))
        A = _with_row(_randn(M, V, gen=g, device=device, scale=3.0), x, pos)
        T = torch.randint(V, (M,), generator=g).to(device)
        T[pos] = t
        ls, tl = log_softmax(A, temperature), token_logprobs(A, T, temperature)
        invariant &= torch.equal(ls[pos], ls1) and torch.equal(tl[pos], tl1)
        gather_equal &= torch.equal(tl, ls.gather(-1, T[:, None])[:, 0])
        ref = torch.log_softmax(A.double() / temperature, -1)
        err = max(err, _rel_err(ls, ref), float((tl.double() - ref.gather(-1, T[:, None])[:, 0]).abs().max()))
    return dict(op="log_softmax", V=V, Ms=list(Ms), invariant=invariant, token_logprobs_equal_gather=gather_equal,
                max_rel_err=err, ok=invariant and gather_equal and err <= tol)


def reference_attention(q, k, v, q_start, kv_lens, scale: float) -> torch.Tensor:
    """Causal GQA attention in float64 with an explicit mask (rows that see no key give 0)."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    qs = torch.as_tensor(q_start, device=q.device).long().expand(B)
    kl = torch.as_tensor(kv_lens, device=q.device).long().expand(B)
    pos = qs[:, None] + torch.arange(Tq, device=q.device)
    keys = torch.arange(Tk, device=q.device)
    visible = (keys[None, None] <= pos[..., None]) & (keys[None, None] < kl[:, None, None])  # [B, Tq, Tk]
    kk = k.double().repeat_interleave(Hq // Hkv, dim=2)
    vv = v.double().repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def check_attention(
    attention: Callable, device, dtype: torch.dtype, lengths: Sequence[int], Hq: int, Hkv: int, D: int,
    chunk_sizes: Sequence[int], n_decode: int, tol: float, seed: int = 0,
) -> dict[str, Any]:
    """Each query's bits: full forward over a right-padded batch vs prefill alone vs chunked
    prefill (each chunk size) vs decode over a cache (alone, batched, and from a heads-first
    cache); plus error against float64."""
    g = _gen(seed)
    B, T = len(lengths), max(lengths)
    q = _randn(B, T, Hq, D, gen=g, device=device, dtype=dtype)
    k = _randn(B, T, Hkv, D, gen=g, device=device, dtype=dtype)
    v = _randn(B, T, Hkv, D, gen=g, device=device, dtype=dtype)
    scale = D**-0.5
    full = attention(q, k, v, scale=scale)
    err = _rel_err(full, reference_attention(q, k, v, 0, T, scale))
    failures: list[str] = []
    for b, L in enumerate(lengths):
        qb, kb, vb = q[b : b + 1, :L], k[b : b + 1, :L], v[b : b + 1, :L]
        want = full[b : b + 1, :L]
        if not torch.equal(attention(qb, kb, vb, scale=scale), want):
            failures.append(f"prefill seq {b}")
        for c in chunk_sizes:
            parts = [
                attention(qb[:, s : s + c], kb[:, : s + c], vb[:, : s + c], q_start=s, scale=scale)
                for s in range(0, L, c)
            ]
            if not torch.equal(torch.cat(parts, dim=1), want):
                failures.append(f"chunked prefill seq {b} chunk {c}")
        # Decode: the query at position p over a cache of p + 1 keys padded to T (kv_lens says which).
        for p in sorted({L - 1, *torch.randint(L, (n_decode,), generator=g).tolist()}):
            out = attention(qb[:, p : p + 1], kb, vb, q_start=p, kv_lens=p + 1, scale=scale)
            if not torch.equal(out[0, 0], want[0, p]):
                failures.append(f"decode seq {b} pos {p}")
    # Batched decode: every sequence's last query together, caches of different lengths.
    last = torch.tensor([L - 1 for L in lengths], device=device)
    qd = torch.stack([q[b, L - 1] for b, L in enumerate(lengths)])[:, None]
    out = attention(qd, k, v, q_start=last, kv_lens=last + 1, scale=scale)
    for b, L in enumerate(lengths):
        if not torch.equal(out[b, 0], full[b, L - 1]):
            failures.append(f"batched decode seq {b}")
    # The same caches stored heads-first [B, Hkv, T, D].
    kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    if not torch.equal(attention(qd, kf, vf, q_start=last, kv_lens=last + 1, scale=scale, heads_first=True), out):
        failures.append("batched decode from a heads-first cache")
    return dict(op="attention", dtype=str(dtype), lengths=list(lengths), Hq=Hq, Hkv=Hkv, D=D,
                chunk_sizes=list(chunk_sizes), invariant=not failures, failures=failures[:10],
                max_rel_err=err, ok=not failures and err <= tol)


def check_gradients(
    ops: dict[str, Callable], device, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, Any]:
    """Gradients of each op vs autograd through reference torch ops (max abs difference)."""
    g = _gen(seed)
    diffs: dict[str, float] = {}

    def compare(name: str, fn: Callable, ref: Callable, *inputs: torch.Tensor) -> None:
        ins = [t.detach().clone().requires_grad_(True) for t in inputs]
        refs = [t.detach().clone().requires_grad_(True) for t in inputs]
        out, ref_out = fn(*ins), ref(*refs)
        w = torch.randn(out.shape, generator=g).to(device=device, dtype=out.dtype)
        a = torch.autograd.grad((out * w).sum(), ins)
        b = torch.autograd.grad((ref_out * w.to(ref_out.dtype)).sum(), refs)
        diffs[name] = max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))

    r = lambda *s, scale=1.0: _randn(*s, gen=g, device=device, dtype=dtype, scale=scale)  # noqa: E731
    if "linear" in ops:
        compare("linear", lambda x, w: ops["linear"](x, w), lambda x, w: F.linear(x, w), r(6, 32), r(24, 32, scale=0.2))
    if "rms_norm" in ops:
        ref = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # noqa: E731
        compare("rms_norm", lambda x, w: ops["rms_norm"](x, w, 1e-6), ref, r(5, 48), r(48) + 1)
    if "log_softmax" in ops:
        compare("log_softmax", lambda x: ops["log_softmax"](x, 0.7), lambda x: torch.log_softmax(x / 0.7, -1),
                r(5, 100))
    if "token_logprobs" in ops:
        t = torch.randint(100, (5,), generator=g).to(device)
        compare("token_logprobs", lambda x: ops["token_logprobs"](x, t, 0.7),
                lambda x: torch.log_softmax(x / 0.7, -1).gather(-1, t[:, None])[:, 0], r(5, 100))
    if "attention" in ops:
        scale = 16**-0.5
        compare("attention", lambda q, k, v: ops["attention"](q, k, v, q_start=3, kv_lens=20, scale=scale),
                lambda q, k, v: reference_attention(q, k, v, 3, 20, scale).to(q.dtype),
                r(2, 17, 4, 16), r(2, 20, 2, 16), r(2, 20, 2, 16))
    worst = max(diffs.values()) if diffs else 0.0
    return dict(op="gradients", dtype=str(dtype), max_abs_diff=diffs, ok=worst <= 1e-5 and not math.isnan(worst))
