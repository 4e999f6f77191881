"""Batch-invariant causal GQA attention on GPU (Triton), one fixed key-block order.

Contract: the same as `titanrl.kernels.cpu_attention` (same arguments, same meaning): a query's
bits depend only on its q row, the keys/values it may see, `scale` and the tile config, not
on the batch, padding, or whether it runs in a full forward, a prefill, a chunked prefill or
decode. One program handles BLOCK_Q queries of one (sequence, query head) and runs the online
softmax over key blocks 0, 1, 2, ... (BLOCK_K keys each) in that order. Query tiles are
aligned to absolute positions (tile rows cover positions a0 .. a0+BLOCK_Q-1 with a0 a multiple
of BLOCK_Q), so a query always sits in the same row of its tile whether it arrives alone
(decode) or inside a long prefill; the products inside a tile therefore see the same operands
in the same place. Blocks past a query's causal limit are exact no-ops for it (p = 0,
rescale exp(0) = 1). Tq and the batch strides are not specialized, so decode (Tq = 1) runs the
same compiled code as prefill.

The backward recomputes attention with torch's `scaled_dot_product_attention` under an
explicit mask and differentiates that (correct gradients, not batch-invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

NEG_BIG = tl.constexpr(-1.0e30)
"""Initial running max: finite, so exp(m_old - m_new) never evaluates inf - inf (a constexpr:
compiled kernels may only read constexpr globals)."""


def default_blocks(q: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_K) for this device: small on Triton's CPU interpreter."""
    return (64, 64) if q.is_cuda else (16, 16)


# Batch-dependent sizes/strides are not specialized: decode (Tq = 1) runs the prefill kernel.
@triton.jit(do_not_specialize=["Tq", "sqb", "skb", "svb", "sob"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, q_start_ptr, kv_len_ptr,
    Tq, Hq, G, D, scale,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    kvh = h // G
    q_start = tl.load(q_start_ptr + b)
    kv_len = tl.load(kv_len_ptr + b)
    a0 = (q_start // BLOCK_Q + tile) * BLOCK_Q          # absolute position of row 0
    pos = a0 + tl.arange(0, BLOCK_Q)                    # absolute position of each row
    qi = pos - q_start                                  # index into this call's queries
    row_ok = (qi >= 0) & (qi < Tq)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(
        q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    m = tl.full((BLOCK_Q,), NEG_BIG, dtype=tl.float32)
    l = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    # Keys up to the tile's last position; none at all for a tile with no query of this call.
    n_keys = tl.minimum(a0 + BLOCK_Q, kv_len)
    n_keys = tl.where(tl.sum(row_ok.to(tl.int32), axis=0) > 0, n_keys, 0)
    for j0 in range(0, n_keys, BLOCK_K):
        keys = j0 + tl.arange(0, BLOCK_K)
        key_ok = keys < kv_len
        k = tl.load(
            k_ptr + b * skb + kvh * skh + keys[:, None] * skt + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :], other=0.0,
        )
        v = tl.load(
            v_ptr + b * svb + kvh * svh + keys[:, None] * svt + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :], other=0.0,
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        o_ptr + b * sob + h * soh + qi[:, None] * sot + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _as_tensor(value, default: int, batch: int, device, name: str) -> torch.Tensor:
    if value is None:
        value = default
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.int32, device=device)
    if value.shape != (batch,):
        raise ValueError(f"attention: {name} must be an int or a [B]={batch} tensor, got shape {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.int32)


def attention_forward(
    q, k, v, q_start_B, kv_len_B, scale: float, blocks: tuple[int, int] | None = None
) -> torch.Tensor:
    """The Triton forward (no autograd); q_start_B and kv_len_B are int32 [B] tensors."""
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    block_q, block_k = blocks or default_blocks(q)
    # Any strides work (a heads-first cache arrives as a transposed view); only head_dim must be
    # unit-stride.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0 or Tq == 0:
        return out
    # Tiles are aligned to absolute positions: one extra tile covers a misaligned start.
    n_tiles = triton.cdiv(Tq, block_q) + 1
    block_d = max(16, triton.next_power_of_2(D))
    grid = (n_tiles, B * Hq)
    _attention_kernel[grid](
        q, k, v, out, q_start_B, kv_len_B,
        Tq, Hq, Hq // Hkv, D, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32, num_warps=8 if block_d >= 128 else 4,
        num_stages=2,  # fp32 at head_dim 128: 115 KB of shared memory (3 stages: 180 KB)
    )
    return out


def reference_attention(q, k, v, q_start_B, kv_len_B, scale: float) -> torch.Tensor:
    """The same function in torch ops (SDPA with an explicit mask); used for the backward."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    pos = q_start_B.long()[:, None] + torch.arange(Tq, device=q.device)[None]
    keys = torch.arange(Tk, device=q.device)
    visible = (keys[None, None] <= pos[:, :, None]) & (keys[None, None] < kv_len_B.long()[:, None, None])
    has_key = visible.any(-1)  # [B, Tq]
    mask = (visible | ~has_key[..., None])[:, None]  # rows with no key: attend anywhere, zeroed below
    G = Hq // Hkv
    kt = k.transpose(1, 2).repeat_interleave(G, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(G, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask, scale=scale).transpose(1, 2)
    return out * has_key[:, :, None, None].to(out.dtype)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_start_B, kv_len_B, scale, blocks):
        ctx.save_for_backward(q, k, v, q_start_B, kv_len_B)
        ctx.scale = scale
        return attention_forward(q, k, v, q_start_B, kv_len_B, scale, blocks)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_start_B, kv_len_B = ctx.saved_tensors
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3])]
            out = reference_attention(*ins, q_start_B, kv_len_B, ctx.scale)
            wanted = [t for t in ins if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return tuple(next(grads) if t.requires_grad else None for t in ins) + (None, None, None, None)


def attention(
    q, k, v, *, q_start=None, kv_lens=None, scale: float | None = None, heads_first: bool = False,
    blocks: tuple[int, int] | None = None,
):
    """Causal GQA attention; see `titanrl.kernels.cpu_attention.attention` for the arguments.

    `heads_first=True` takes k, v as [B, Hkv, Tk, D] (read in place through strides).
    `blocks` overrides (BLOCK_Q, BLOCK_K); bits are invariant within one setting.
    """
    if heads_first and k.dim() == 4 and v.dim() == 4:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError("attention: q must be [B, Tq, Hq, D] and k, v [B, Tk, Hkv, D] with matching B and D")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"attention: query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    B = q.shape[0]
    q_start_B = _as_tensor(q_start, 0, B, q.device, "q_start")
    kv_len_B = _as_tensor(kv_lens, k.shape[1], B, q.device, "kv_lens")
    scale = q.shape[3] ** -0.5 if scale is None else scale
    return _TritonAttention.apply(q, k, v, q_start_B, kv_len_B, scale, blocks)
