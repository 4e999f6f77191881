"""Batch-invariant causal grouped-query attention on CPU: one C++ kernel for every caller.

Contract: a query's output bits depend only on its own q row, on the keys/values it may see
(positions 0..its own position, below its sequence's `kv_lens`) and on `scale`. They do not
depend on the batch size, on the other sequences or queries in the call, on padding, on the
thread count, on how the sequence was split into calls, or on where the keys are stored. So
one query gets the same bits in
  (a) a full causal forward over a right-padded batch [B, T] (the trainer),
  (b) a prefill of its sequence alone,
  (c) a chunked prefill (keys = earlier chunks + the current chunk, `q_start` = chunk start),
  (d) decode, reading vLLM's paged KV cache in place (`varlen_attention` with `KeyTable`).

How: `csrc/attention.cpp` computes each (query, head) on its own with one fixed arithmetic:
fixed-lane dot products over head_dim, then max, exp, sum and the weighted sum of values
sequentially over keys 0, 1, ..., n-1. There are no GEMMs (whose per-row bits on this CPU
depend on the row count; see `torch_linear`), no padding and no key blocks, and the kernel
takes an address scheme instead of a tensor layout, so decode never gathers the cache.

The backward pass runs in torch from the saved log-sum-exp (standard attention gradients;
only the forward's bits are part of the contract).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from titanrl.kernels import cpu_build

BACKWARD_QUERY_TILE = 256
"""Queries per tile of the backward pass; bounds its [B, Hq, tile, Tk] score memory."""


@dataclass(frozen=True)
class KeyTable:
    """Where each request's keys and values live, for reading a cache in place.

    Key j of kv head h of request r starts at element
    `table[r, j // block_size] * block_stride + h * head_stride + (j % block_size) * token_stride`
    of `keys` (its value at the same offset of `values`); each is head_dim contiguous elements.
    A dense [B, T, Hkv, D] tensor is one block per sequence (`KeyTable.dense`); vLLM's paged
    cache is its block table with the cache's strides.
    """

    keys: torch.Tensor
    """Tensor whose storage holds the keys (only its data pointer and dtype are read)."""
    values: torch.Tensor
    """Tensor whose storage holds the values, laid out like `keys`."""
    table: torch.Tensor
    """[R, max_blocks] int64 block ids per request."""
    block_size: int
    """Keys per block."""
    block_stride: int
    """Elements between consecutive blocks."""
    head_stride: int
    """Elements between consecutive kv heads within a block."""
    token_stride: int
    """Elements between consecutive keys within a block."""

    @staticmethod
    def dense(k: torch.Tensor, v: torch.Tensor, heads_first: bool) -> "KeyTable":
        """[B, Tk, Hkv, D] tensors (or [B, Hkv, Tk, D] with `heads_first`), read through their strides."""
        head_dim, token_dim = (1, 2) if heads_first else (2, 1)
        B, Tk = k.shape[0], k.shape[token_dim]
        return KeyTable(keys=k, values=v, table=torch.arange(B, dtype=torch.long)[:, None], block_size=max(Tk, 1),
                        block_stride=k.stride(0), head_stride=k.stride(head_dim), token_stride=k.stride(token_dim))


def _pointer(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def varlen_attention(
    q_NHD: torch.Tensor, source: KeyTable, num_kv_heads: int, query_start: torch.Tensor, first_pos: torch.Tensor,
    kv_len: torch.Tensor, scale: float, *, out: torch.Tensor | None = None, with_lse: bool = False,
    plain_loops: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward attention for R requests whose queries are flattened into q_NHD [N, Hq, D].

    Request r owns rows `query_start[r]:query_start[r + 1]`; its first query is at position
    `first_pos[r]`, and a query at position p sees keys 0..min(p + 1, kv_len[r]) - 1 of
    `source`; query head h reads kv head h // (Hq // num_kv_heads). q, keys and values share
    one dtype (float32 or float64); rows must have contiguous head_dim. `plain_loops` runs the
    kernel's scalar definition instead of its vector path (same bits, slower; for tests).
    Returns (out [N, Hq, D], lse [N, Hq] or None). No autograd. The kernel trusts `source` to
    address memory inside its tensors; the shapes checked here are the ones a caller can get
    wrong by a row.
    """
    N, Hq, D = q_NHD.shape
    dtype = q_NHD.dtype
    if dtype not in (torch.float32, torch.float64) or source.keys.dtype != dtype or source.values.dtype != dtype:
        raise TypeError(f"attention kernel: q, keys and values must share float32 or float64, got {dtype}, "
                        f"{source.keys.dtype}, {source.values.dtype}")
    if q_NHD.device.type != "cpu" or source.keys.device.type != "cpu":
        raise ValueError("attention kernel: the C++ kernel runs on CPU tensors only")
    if q_NHD.stride(-1) != 1:
        raise ValueError("attention kernel: q rows must have contiguous head_dim")
    if Hq % num_kv_heads:
        raise ValueError(f"attention: query heads ({Hq}) must be a multiple of kv heads ({num_kv_heads})")
    R = first_pos.shape[0]
    if query_start.shape != (R + 1,) or kv_len.shape != (R,) or source.table.shape[0] < R:
        raise ValueError(f"attention kernel: {R} requests need query_start [{R + 1}], kv_len [{R}] and a block "
                         f"table of >= {R} rows, got {tuple(query_start.shape)}, {tuple(kv_len.shape)}, "
                         f"{tuple(source.table.shape)}")
    if R and int(query_start[-1]) > N:
        raise ValueError(f"attention kernel: query_start ends at {int(query_start[-1])} but q has {N} rows")
    if out is None:
        out = torch.empty((N, Hq, D), dtype=dtype)
    elif out.shape != (N, Hq, D) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"attention kernel: out must be [{N}, {Hq}, {D}] {dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    lse = torch.empty((N, Hq), dtype=dtype) if with_lse else None
    table = source.table.contiguous()
    index = [t.to(torch.long).contiguous() for t in (query_start, first_pos, kv_len)]
    lib = cpu_build.load("attention")
    fn = lib.titanrl_attention_forward_f64 if dtype == torch.float64 else lib.titanrl_attention_forward_f32
    fn(_pointer(q_NHD), ctypes.c_int64(q_NHD.stride(0)), ctypes.c_int64(q_NHD.stride(1)),
       _pointer(source.keys), _pointer(source.values), _pointer(table), ctypes.c_int64(table.stride(0)),
       ctypes.c_int64(source.block_size), ctypes.c_int64(source.block_stride), ctypes.c_int64(source.head_stride),
       ctypes.c_int64(source.token_stride), *[_pointer(t) for t in index], ctypes.c_int64(R), ctypes.c_int64(Hq),
       ctypes.c_int64(num_kv_heads), ctypes.c_int64(D), ctypes.c_double(scale), _pointer(out),
       ctypes.c_int64(out.stride(0)), ctypes.c_int64(out.stride(1)), _pointer(lse) if lse is not None else ctypes.c_void_p(0),
       ctypes.c_int(torch.get_num_threads()), ctypes.c_int(int(plain_loops)))
    return out, lse


def _per_sequence(value: torch.Tensor | int | None, default: int, batch: int, name: str) -> torch.Tensor:
    if value is None:
        value = default
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long)
    if value.shape != (batch,):
        raise ValueError(f"attention: {name} must be an int or a [B]={batch} tensor, got shape {tuple(value.shape)}")
    return value.to(device="cpu", dtype=torch.long)


def _dense_forward(q, k, v, starts, lens, scale, heads_first, with_lse):
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[1] if heads_first else k.shape[2]
    out, lse = varlen_attention(
        q.reshape(B * Tq, Hq, D), KeyTable.dense(k, v, heads_first), Hkv, torch.arange(B + 1, dtype=torch.long) * Tq,
        starts, lens, scale, with_lse=with_lse,
    )
    return out.view(B, Tq, Hq, D), lse.view(B, Tq, Hq) if lse is not None else None


class _Attention(torch.autograd.Function):
    """Dense attention: the C++ forward, and a torch backward from its log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, starts, lens, scale, heads_first):
        out, lse = _dense_forward(q, k, v, starts, lens, scale, heads_first, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, starts, lens)
        ctx.scale, ctx.heads_first = scale, heads_first
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, starts, lens = ctx.saved_tensors
        if not ctx.heads_first:  # keys and values heads first: [B, Hkv, Tk, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        B, Tq, Hq, D = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        G = Hq // Hkv

        def grouped(t: torch.Tensor) -> torch.Tensor:  # [B, Tq, Hq, ...] -> [B, Hkv, G, Tq, ...]
            return t.reshape(B, Tq, Hkv, G, *t.shape[3:]).movedim(1, 3)

        qg, og, gg, lse_g = grouped(q), grouped(out), grouped(grad_out.to(q.dtype)), grouped(lse)
        dq = torch.empty((B, Hkv, G, Tq, D), dtype=q.dtype)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for t0 in range(0, Tq, BACKWARD_QUERY_TILE):
            t1 = min(t0 + BACKWARD_QUERY_TILE, Tq)
            # Keys past the tile's last visible position get no gradient from it: skip them.
            n = min(Tk, int(starts.max()) + t1, int(lens.max()))
            if n <= 0:
                dq[:, :, :, t0:t1] = 0
                continue
            pos = starts[:, None] + torch.arange(t0, t1)
            keys = torch.arange(n)
            visible = (keys <= pos[..., None]) & (keys < lens[:, None, None])  # [B, tile, n]
            rows = lambda t: t[:, :, :, t0:t1].reshape(B, Hkv, G * (t1 - t0), *t.shape[4:])  # noqa: E731
            qt, ot, gt, lt = rows(qg), rows(og), rows(gg), rows(lse_g)
            kn, vn = k[:, :, :n], v[:, :, :n]
            s = (qt @ kn.transpose(-1, -2)) * ctx.scale  # [B, Hkv, G * tile, n]
            s = s.masked_fill(~visible[:, None, None].expand(B, 1, G, t1 - t0, n).reshape(B, 1, -1, n), float("-inf"))
            # lse is +inf for a query that sees no key: its probabilities are all exp(-inf) = 0.
            p = torch.exp(s - lt[..., None])
            dv[:, :, :n] += p.transpose(-1, -2) @ gt
            ds = p * (gt @ vn.transpose(-1, -2) - (gt * ot).sum(-1, keepdim=True))
            dq[:, :, :, t0:t1] = ((ds @ kn) * ctx.scale).view(B, Hkv, G, t1 - t0, D)
            dk[:, :, :n] += (ds.transpose(-1, -2) @ qt) * ctx.scale
        if not ctx.heads_first:
            dk, dv = dk.transpose(1, 2), dv.transpose(1, 2)
        return dq.movedim(3, 1).reshape(B, Tq, Hq, D), dk, dv, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: torch.Tensor | int | None = None,
    kv_lens: torch.Tensor | int | None = None,
    scale: float | None = None,
    heads_first: bool = False,
) -> torch.Tensor:
    """Causal GQA softmax(q k^T * scale) v, with the bits of the module docstring.

    q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq a multiple of Hkv (query head h uses kv
    head h // (Hq // Hkv), as `repeat_interleave` does), or [B, Hkv, Tk, D] with
    `heads_first=True` (read in place; the bits are the same either way). Keys/values at
    positions a query may not see are never read.
    q_start: position of q[:, 0] in each sequence (int or [B]); default 0.
    kv_lens: number of valid keys per sequence (int or [B]); default Tk.
    Query i of sequence b is at position q_start[b] + i and attends to keys j with
    j <= q_start[b] + i and j < kv_lens[b]. A query that can see no key returns zeros.
    scale: default head_dim ** -0.5.
    Returns [B, Tq, Hq, D] in q's dtype (computed in float32, or float64 for float64).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention: q, k, v must be 4-D: q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D]")
    B, Tq, Hq, D = q.shape
    Tk, Hkv = (k.shape[2], k.shape[1]) if heads_first else (k.shape[1], k.shape[2])
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        layout = "[B, Hkv, Tk, D]" if heads_first else "[B, Tk, Hkv, D]"
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be {layout}, B={B}, D={D}")
    if Hq % Hkv:
        raise ValueError(f"attention: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    starts = _per_sequence(q_start, 0, B, "q_start")
    lens = _per_sequence(kv_lens, Tk, B, "kv_lens")
    if bool(((lens > Tk) | (lens < 0)).any()):
        raise ValueError(f"attention: kv_lens must lie in [0, Tk={Tk}], got {lens.tolist()}")
    if B == 0 or Tq == 0:
        return q.new_zeros(q.shape)
    scale = D**-0.5 if scale is None else scale
    dtype = q.dtype
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    q, k, v = q.to(cdtype).contiguous(), k.to(cdtype), v.to(cdtype)
    if k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    if needs_grad:
        out = _Attention.apply(q, k, v, starts, lens, scale, heads_first)
    else:
        out, _ = _dense_forward(q, k, v, starts, lens, scale, heads_first, with_lse=False)
    return out.to(dtype)
