"""Context parallel: causal ring attention over sequence chunks, with its own backward.

Each CP rank holds a part of every sequence. Keys and values travel around the ring of CP
ranks (isend/irecv to the next, from the previous); every rank attends its queries to each
block as it passes, merging partial results with their log-sum-exp. The backward pass sends
the blocks around again, each with its dK/dV accumulator, which arrives home after a full turn.

Load balancing: with causal masking the rank holding the sequence's end does the most work.
Cutting the sequence into 2 * cp chunks and giving rank r chunks r and 2cp-1-r evens it out.
Chunk pairs are whole: a query chunk attends fully to earlier key chunks, causally to its own
chunk and not at all to later ones, so no row ever sees an all-masked block.

PyTorch's own context parallel has no CPU attention strategy (see ENVIRONMENT.md); this one is
plain matmuls in float32 and runs on gloo and NCCL alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ContextLayout:
    """Which chunks of a sequence one CP rank holds."""

    cp: int
    """Context-parallel degree (ranks in the ring)."""
    rank: int
    """This rank's index in the ring."""
    load_balance: bool = True
    """2 * cp chunks, rank r holding r and 2cp-1-r (balanced causal work); else cp contiguous chunks."""

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp if self.load_balance else self.cp

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """Global chunk indices held by `rank` (default: this rank), in local order."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.cp - 1 - r) if self.load_balance else (r,)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full-sequence tensor (the sequence length must divide into chunks)."""
        if x.shape[dim] % self.num_chunks:
            raise ValueError(
                f"sequence length {x.shape[dim]} is not a multiple of the {self.num_chunks} context-parallel chunks"
            )
        chunks = x.chunk(self.num_chunks, dim)
        return torch.cat([chunks[i] for i in self.chunk_ids()], dim)

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions [local_len] of this rank's tokens."""
        ids = self.chunk_ids()
        c = local_len // len(ids)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def _ring_shift(tensors: list[torch.Tensor], group: dist.ProcessGroup, layout: ContextLayout):
    """Starts sending `tensors` to the next rank and receiving the previous rank's; returns (works, received)."""
    nxt, prv = (layout.rank + 1) % layout.cp, (layout.rank - 1) % layout.cp
    received = [torch.empty_like(t) for t in tensors]
    ops = []
    for tag, (t, r) in enumerate(zip(tensors, received, strict=True)):
        ops.append(dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=nxt))
        ops.append(dist.P2POp(dist.irecv, r, group=group, tag=tag, group_peer=prv))
    return dist.batch_isend_irecv(ops), received


def _block_pairs(layout: ContextLayout, src_rank: int):
    """(local query chunk, local key chunk of src, is diagonal) for every pair that is not fully masked."""
    for qi, qid in enumerate(layout.chunk_ids()):
        for ki, kid in enumerate(layout.chunk_ids(src_rank)):
            if kid <= qid:
                yield qi, ki, kid == qid


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, K, T, D] -> [B, K*groups, T, D] (query head h uses key head h // groups)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of _expand for gradients: sums each key head's query-head group."""
    if groups == 1:
        return grad
    B, H, T, D = grad.shape
    return grad.view(B, H // groups, groups, T, D).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        c = s.shape[-1]
        causal = torch.ones(c, c, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BTHD, k_BTKD, v_BTKD, scale: float, group: dist.ProcessGroup, layout: ContextLayout):
        q = q_BTHD.transpose(1, 2).float()  # [B, H, T, D]
        kv = torch.stack([k_BTKD.transpose(1, 2).float(), v_BTKD.transpose(1, 2).float()]).contiguous()
        groups = q.shape[1] // kv.shape[2]
        n = len(layout.chunk_ids())
        c = q.shape[2] // n
        own_kv = kv
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(layout.cp):
            src = (layout.rank - step) % layout.cp
            works, nxt = _ring_shift([kv], group, layout) if step < layout.cp - 1 else ([], None)
            k, v = _expand(kv[0], groups), _expand(kv[1], groups)
            for qi, ki, diagonal in _block_pairs(layout, src):
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                s = _scores(q[:, :, qs], k[:, :, ks], scale, diagonal)
                block_lse = s.logsumexp(-1)
                block_out = torch.exp(s - block_lse[..., None]) @ v[:, :, ks]
                new_lse = torch.logaddexp(lse[:, :, qs], block_lse)
                out[:, :, qs] = (
                    out[:, :, qs] * torch.exp(lse[:, :, qs] - new_lse)[..., None]
                    + block_out * torch.exp(block_lse - new_lse)[..., None]
                )
                lse[:, :, qs] = new_lse
            for w in works:
                w.wait()
            if nxt is not None:
                kv = nxt[0]
        ctx.save_for_backward(q, own_kv, out, lse)
        ctx.scale, ctx.group, ctx.layout, ctx.groups, ctx.chunk = scale, group, layout, groups, c
        ctx.dtypes = (q_BTHD.dtype, k_BTKD.dtype, v_BTKD.dtype)
        return out.to(q_BTHD.dtype).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout_BTHD):
        q, kv, out, lse = ctx.saved_tensors
        scale, group, layout, groups, c = ctx.scale, ctx.group, ctx.layout, ctx.groups, ctx.chunk
        dout = dout_BTHD.transpose(1, 2).float()
        delta = (dout * out).sum(-1)  # [B, H, T]: rowsum(dO * O) of the softmax backward
        dq = torch.zeros_like(q)
        dkv = torch.zeros_like(kv)  # travels with kv: gradient of the block currently held
        for step in range(layout.cp):
            src = (layout.rank - step) % layout.cp
            k, v = _expand(kv[0], groups), _expand(kv[1], groups)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            for qi, ki, diagonal in _block_pairs(layout, src):
                qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c)
                p = torch.exp(_scores(q[:, :, qs], k[:, :, ks], scale, diagonal) - lse[:, :, qs, None])
                dv[:, :, ks] += p.transpose(-1, -2) @ dout[:, :, qs]
                ds = p * (dout[:, :, qs] @ v[:, :, ks].transpose(-1, -2) - delta[:, :, qs, None])
                dq[:, :, qs] += (ds @ k[:, :, ks]) * scale
                dk[:, :, ks] += (ds.transpose(-1, -2) @ q[:, :, qs]) * scale
            dkv = dkv + torch.stack([_fold(dk, groups), _fold(dv, groups)])
            # Pass the block on with its gradient; after cp passes each gradient is home.
            tensors = [dkv] if step == layout.cp - 1 else [kv, dkv.contiguous()]
            works, received = _ring_shift(tensors, group, layout)
            for w in works:
                w.wait()
            if step < layout.cp - 1:
                kv, dkv = received
            else:
                dkv = received[0]
        dq_t, dk_t, dv_t = (g.transpose(1, 2).to(dt) for g, dt in zip((dq, dkv[0], dkv[1]), ctx.dtypes, strict=True))
        return dq_t, dk_t, dv_t, None, None, None


class RingAttention(nn.Module):
    """Attention backend (called as backend(q, k, v) on [B, T_local, heads, head_dim]) for CP ranks.

    Replaces `CausalSDPA` in every decoder layer; holds no parameters, so the model's state
    dict is unchanged. Inputs must already carry global rotary positions (ContextLayout.positions).
    """

    def __init__(self, group: dist.ProcessGroup, layout: ContextLayout) -> None:
        super().__init__()
        self.group, self.layout = group, layout

    def forward(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor) -> torch.Tensor:
        if q_BTHD.shape[1] % len(self.layout.chunk_ids()):
            raise ValueError(f"local sequence length {q_BTHD.shape[1]} does not split into this rank's chunks")
        return _RingAttention.apply(q_BTHD, k_BTKD, v_BTKD, q_BTHD.shape[-1] ** -0.5, self.group, self.layout)
