"""Variable-length sequences packed end to end into one row of tokens, and attention over them.

The trainer packs a micro-batch's samples into one row [1, N] of only their real tokens (no
padding), so every projection, norm and MLP computes exactly the tokens the loss needs. Only
attention has to know where one sequence ends: `PackedSequences` is that layout, set on the
model's attention backends for the duration of a forward and its backward
(`packed_attention_layout`), in the way vLLM's forward context tells its attention where each
request's tokens are. Positions (rotary) restart at 0 in every sequence and come in with the ids.

`packed_attention` runs an attention function over the layout: on CUDA, through torch's varlen
flash kernel (`torch.nn.attention.varlen.varlen_attn`) where it exists; elsewhere (CPU, and any
backend that wants a padded batch, such as the batch-invariant kernel) it scatters the packed
q/k/v into a right-padded [S, max_len] batch for the attention call alone and gathers the result
back. Causal attention never lets a real token see the padding after it, so each sequence's
output is what it would be unpacked.

Shared prefixes: the samples of a GRPO group start with the same prompt, whose hidden states are
the same in every sample (attention is causal). The packed row can then hold each prompt once;
`PackedSequences.shared_*` lists the extra slots where a prompt token's keys and values appear
again, at the head of each other sequence that starts with that prompt. Only attention sees the
copies (gradients from every copy add up in the one token), so the projections, norms and MLPs
compute the prompt once per group.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""A padded-batch causal attention: (q [B, T, H, D], k [B, T, K, D], v [B, T, K, D]) -> [B, T, H, D]."""


@dataclass(frozen=True)
class PackedSequences:
    """Where each sequence of a packed row [1, N] starts and ends."""

    sequence_of_token: torch.Tensor
    """[N] int64: the index (0..S-1) of the sequence each packed token belongs to."""
    position_of_token: torch.Tensor
    """[N] int64: each token's position inside its sequence (0 at its first token)."""
    cu_seqlens: torch.Tensor
    """[S + 1] int32: sequence s holds packed tokens cu_seqlens[s] .. cu_seqlens[s + 1] - 1."""
    max_len: int
    """Length of the longest sequence (its shared prefix included)."""
    shared_token_E: torch.Tensor | None = None
    """[E] int64: packed tokens whose keys and values also sit at the head of another sequence
    (a prefix it shares with the sequence that holds the token); None: no sequence shares one."""
    shared_sequence_E: torch.Tensor | None = None
    """[E] int64: the sequence each shared copy goes into."""
    shared_position_E: torch.Tensor | None = None
    """[E] int64: the copy's position there (that of the token in its own sequence)."""

    @property
    def shares_prefixes(self) -> bool:
        return self.shared_token_E is not None and self.shared_token_E.numel() > 0

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> PackedSequences:
        """The layout of sequences of `lengths` (each >= 1) laid end to end, in order."""
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packed sequences need at least one token each, got lengths {lengths}")
        lengths_S = torch.tensor(lengths, dtype=torch.long, device=device)
        starts_S = torch.cumsum(lengths_S, 0) - lengths_S
        sequence_N = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_S)
        position_N = torch.arange(int(lengths_S.sum()), device=device) - starts_S[sequence_N]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths_S, 0)
        return cls(sequence_N, position_N, cu, max(lengths))


def _varlen_kernel() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.9
        return None
    return varlen_attn


def packed_attention(attend: Attend, q_1NHD: torch.Tensor, k_1NKD: torch.Tensor, v_1NKD: torch.Tensor,
                     packed: PackedSequences) -> torch.Tensor:
    """`attend` (causal, over a right-padded batch) applied to each packed sequence: [1, N, H, D].

    The padded batch exists only around the attention call ([S, max_len] rows; its pad slots are
    zeros that no real query attends to), so its cost is attention's alone.
    """
    index = (packed.sequence_of_token, packed.position_of_token)
    kv_index, kv_source = index, None
    if packed.shares_prefixes:  # keys and values also fill the shared-prefix slots (queries don't)
        kv_index = (torch.cat([index[0], packed.shared_sequence_E]), torch.cat([index[1], packed.shared_position_E]))
        kv_source = packed.shared_token_E

    def padded(t_1NXD: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], copies: torch.Tensor | None
               ) -> torch.Tensor:
        shape = (packed.num_sequences, packed.max_len, *t_1NXD.shape[2:])
        values = t_1NXD[0] if copies is None else torch.cat([t_1NXD[0], t_1NXD[0][copies]])
        return t_1NXD.new_zeros(shape).index_put(slots, values)

    out_SLHD = attend(padded(q_1NHD, index, None), padded(k_1NKD, kv_index, kv_source),
                      padded(v_1NKD, kv_index, kv_source))
    return out_SLHD[index][None]


def varlen_flash_attention(q_1NHD: torch.Tensor, k_1NKD: torch.Tensor, v_1NKD: torch.Tensor,
                           packed: PackedSequences, scale: float) -> torch.Tensor | None:
    """Causal attention of the packed sequences through torch's varlen flash kernel (CUDA, half
    precision), or None where that kernel cannot run (then use `packed_attention`): also for
    shared prefixes, whose keys the kernel's contiguous sequences cannot hold twice."""
    kernel = _varlen_kernel()
    half = q_1NHD.dtype in (torch.float16, torch.bfloat16)
    if packed.shares_prefixes or kernel is None or not q_1NHD.is_cuda or not half:
        return None
    causal, takes_gqa = _varlen_options(kernel)
    if causal is None:
        return None
    q_NHD, k_NKD, v_NKD = q_1NHD[0], k_1NKD[0], v_1NKD[0]
    gqa = q_NHD.shape[1] != k_NKD.shape[1]
    if gqa and not takes_gqa:  # older torch: give each query head its own copy of its kv head
        groups = q_NHD.shape[1] // k_NKD.shape[1]
        k_NKD, v_NKD = k_NKD.repeat_interleave(groups, dim=1), v_NKD.repeat_interleave(groups, dim=1)
    options = dict(causal, scale=scale, **({"enable_gqa": gqa} if takes_gqa else {}))
    cu = packed.cu_seqlens.to(q_1NHD.device)
    return kernel(q_NHD, k_NKD, v_NKD, cu, cu, packed.max_len, packed.max_len, **options)[None]


@functools.cache
def _varlen_options(kernel: Callable) -> tuple[dict | None, bool]:
    """How this torch's `varlen_attn` says "causal" (torch 2.13: `window_size=(-1, 0)`; earlier
    releases: `is_causal=True`; None where it cannot), and whether it takes `enable_gqa` (torch
    2.11 does not: measured on an H200, 2026-12-04)."""
    parameters = inspect.signature(kernel).parameters
    if "window_size" in parameters:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        causal = None
    return causal, "enable_gqa" in parameters


@contextlib.contextmanager
def packed_attention_layout(model: nn.Module, packed: PackedSequences) -> Iterator[None]:
    """Every attention backend of `model` (those with a `packed` attribute) treats its input as
    `packed` until the block exits. Keep it open through the backward: activation checkpointing
    recomputes attention there."""
    backends = [m for m in model.modules() if hasattr(m, "packed")]
    if not backends:
        raise TypeError(f"{type(model).__name__} has no attention backend that can run packed sequences")
    for m in backends:
        m.packed = packed
    try:
        yield
    finally:
        for m in backends:
            m.packed = None
