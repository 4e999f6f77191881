"""Batch-invariant causal grouped-query attention on CPU, in one fixed key-block order.

Contract: a query's output bits depend only on its own q row, on the keys/values it may see
(positions 0..its own position, below its sequence's `kv_lens`) and on `block_size` and
`scale`. They do not depend on the batch size, on the other sequences or queries in the call,
on padding, or on how the sequence was split into calls. So one query gets the same bits in
  (a) a full causal forward over a right-padded batch [B, T],
  (b) a prefill of its sequence alone,
  (c) a chunked prefill (keys = earlier chunks + the current chunk, `q_start` = chunk start),
  (d) decode (one query over a cache of any length, `q_start` = length - 1).

How: keys are cut into blocks of `block_size` starting at key 0, and every query runs the
online softmax over blocks 0, 1, 2, ... in that order. Inside a block the two products
((q * scale) @ k^T and p @ v) are batched GEMMs whose per-row bits do not depend on how many rows the
GEMM holds, as long as that count is a multiple of 4 and the output width a multiple of 16
(the MKL behaviour documented in `titanrl.kernels.torch_linear`; checked for batched matmul too):
query rows are padded to a multiple of 4, `block_size` must be a multiple of 16 and head_dim is
zero-padded to a multiple of 16. Max, exp, sum and the update use ops whose bits depend only
on their own row. A block that lies entirely past a query's causal limit (processed because
another query in the same tile needs it) is an exact no-op for that query: its scores are
-inf, so p = 0, the rescale factor is exp(0) = 1, and adding zeros changes nothing.

Reading keys from a cache: `k`/`v` are per-sequence [B, L, Hkv, D] tensors (or [B, Hkv, L, D]
with `heads_first=True`, which is read without a copy when contiguous, float32 and L a
multiple of `block_size`). An adapter for vLLM's paged cache gathers each request's keys from
its block table into such a tensor (padding requests to a common length, with `kv_lens`
saying how many are real, padding zero-filled) and calls this same function with
`q_start` = the number of tokens already in the cache before this step's queries.

Gradients flow through plain torch ops (the running max is a detached stabilizer: the output
does not depend on it mathematically).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_TILE = 64
"""Queries processed together per pass over the key blocks; affects speed, never the bits."""


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _per_sequence(value: torch.Tensor | int | None, default: int, batch: int, name: str) -> list[int]:
    if value is None:
        return [default] * batch
    if isinstance(value, int):
        return [value] * batch
    if value.shape != (batch,):
        raise ValueError(f"attention: {name} must be an int or a [B]={batch} tensor, got shape {tuple(value.shape)}")
    return [int(x) for x in value.tolist()]


def _blocked(
    x: torch.Tensor, heads_first: bool, n_blocks: int, block_size: int, Dp: int, dtype: torch.dtype
) -> torch.Tensor:
    """Keys or values as [B * H, n_blocks, block_size, Dp]: each block a contiguous matrix.

    A heads-first [B, H, T, D] tensor that is already contiguous, block-aligned (T a multiple
    of block_size), 16-aligned (D = Dp) and of the compute dtype is used as it is (no copy);
    anything else is copied once into that layout, with zero padding.
    """
    src = x if heads_first else x.transpose(1, 2)
    B, H, T, D = src.shape
    if src.is_contiguous() and T == n_blocks * block_size and D == Dp and src.dtype == dtype:
        return src.view(B * H, n_blocks, block_size, Dp)
    out = torch.empty((B, H, n_blocks * block_size, Dp), dtype=dtype, device=x.device)
    out[:, :, :T, :D] = src
    out[:, :, T:].zero_()
    if Dp != D:
        out[..., D:].zero_()
    return out.view(B * H, n_blocks, block_size, Dp)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: torch.Tensor | int | None = None,
    kv_lens: torch.Tensor | int | None = None,
    scale: float | None = None,
    block_size: int = 64,
    heads_first: bool = False,
) -> torch.Tensor:
    """Causal GQA softmax(q k^T * scale) v with a fixed key-block order.

    q: [B, Tq, Hq, D]; k, v: [B, Tk, Hkv, D] with Hq a multiple of Hkv (query head h uses kv
    head h // (Hq // Hkv), as `repeat_interleave` does), or [B, Hkv, Tk, D] with
    `heads_first=True` (a contiguous, float32, block-aligned cache in that layout is read with
    no copy; the bits are the same either way). Keys/values at masked positions are never
    attended to but must be finite (0 * nan would still be nan).
    q_start: position of q[:, 0] in each sequence (int or [B]); default 0.
    kv_lens: number of valid keys per sequence (int or [B]); default Tk.
    Query i of sequence b is at position q_start[b] + i and attends to keys j with
    j <= q_start[b] + i and j < kv_lens[b]. A query that can see no key returns zeros.
    scale: default head_dim ** -0.5. block_size: keys per block, a multiple of 16.
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
    if block_size <= 0 or block_size % 16:
        raise ValueError(f"attention: block_size must be a positive multiple of 16, got {block_size}")
    starts = _per_sequence(q_start, 0, B, "q_start")
    lens = _per_sequence(kv_lens, Tk, B, "kv_lens")
    if any(n > Tk or n < 0 for n in lens):
        raise ValueError(f"attention: kv_lens must lie in [0, Tk={Tk}], got {lens}")
    if B == 0 or Tq == 0:
        return q.new_zeros(q.shape)
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    Dp, Tkp = _round_up(D, 16), _round_up(max(Tk, 1), block_size)
    n_blocks = Tkp // block_size
    # Autograd needs out-of-place updates; inference reuses buffers in place.
    inplace = not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))

    # Rows of each (sequence, kv head) are (query, group) pairs: [B, Hkv, Tq * G, Dp]; q is
    # pre-scaled once (one exact-per-element multiply) instead of scaling every score block.
    qh = (q.to(cdtype) * scale).reshape(B, Tq, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, Tq * G, D)
    # Keys/values as [B * Hkv, n_blocks, block, Dp]: every block is a contiguous matrix, laid
    # out identically whatever the cache length, and `kh[:, j]` is a strided batch for `bmm`.
    kh = _blocked(k, heads_first, n_blocks, block_size, Dp, cdtype)
    vh = _blocked(v, heads_first, n_blocks, block_size, Dp, cdtype)
    if Dp != D:
        qh = F.pad(qh, (0, Dp - D))
    start_B = torch.tensor(starts, dtype=torch.long, device=dev)
    len_B = torch.tensor(lens, dtype=torch.long, device=dev)
    keys = torch.arange(Tkp, device=dev)
    lowest = torch.finfo(cdtype).min

    tiles = []
    for t0 in range(0, Tq, QUERY_TILE):
        t1 = min(t0 + QUERY_TILE, Tq)
        rows = qh[:, :, t0 * G : t1 * G]
        R = rows.shape[2]
        Rp = _round_up(R, 4)  # MKL's row-count class: see titanrl.kernels.torch_linear
        rows = F.pad(rows, (0, 0, 0, Rp - R)) if Rp != R else rows.contiguous()
        rows = rows.view(B * Hkv, Rp, Dp)
        # Absolute position of each row's query [B, Rp]; padding rows reuse the last query's.
        qidx = torch.arange(t0, t1, device=dev).repeat_interleave(G)
        if Rp != R:
            qidx = torch.cat([qidx, qidx[-1:].expand(Rp - R)])
        pos = start_B[:, None] + qidx[None]
        hidden = (keys[None, None, :] > pos[:, :, None]) | (keys[None, None, :] >= len_B[:, None, None])
        hidden = hidden[:, None]  # [B, 1, Rp, Tkp], shared by the kv heads
        last_key = min(max(s + t1 - 1 for s in starts), max(lens) - 1)
        # Running max starts at the lowest finite value, not -inf: a row that has seen no key
        # yet then gets exp(-inf - lowest) = 0 instead of exp(-inf + inf) = nan.
        m = torch.full((B * Hkv, Rp), lowest, dtype=cdtype, device=dev)
        l = torch.zeros((B * Hkv, Rp), dtype=cdtype, device=dev)
        acc = torch.zeros((B * Hkv, Rp, Dp), dtype=cdtype, device=dev)
        for j in range(max(last_key, 0) // block_size + 1):
            j0 = j * block_size
            s = torch.bmm(rows, kh[:, j].transpose(1, 2)).view(B, Hkv, Rp, block_size)
            s = s.masked_fill(hidden[..., j0 : j0 + block_size], float("-inf")).view(B * Hkv, Rp, block_size)
            with torch.no_grad():
                m_new = torch.maximum(m, s.amax(-1))
            if inplace:
                p = s.sub_(m_new[..., None]).exp_()
                alpha = m.sub_(m_new).exp_()
                l.mul_(alpha).add_(p.sum(-1))
                acc.mul_(alpha[..., None]).add_(torch.bmm(p, vh[:, j]))
            else:
                p = torch.exp(s - m_new[..., None])
                alpha = torch.exp(m - m_new)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.bmm(p, vh[:, j])
            m = m_new
        l = torch.where(l == 0, torch.ones_like(l), l)
        tiles.append((acc / l[..., None]).view(B, Hkv, Rp, Dp)[:, :, :R])
    out = torch.cat(tiles, dim=2) if len(tiles) > 1 else tiles[0]
    out = out.reshape(B, Hkv, Tq, G, Dp).permute(0, 2, 1, 3, 4).reshape(B, Tq, Hq, Dp)
    return out[..., :D].to(q.dtype)
