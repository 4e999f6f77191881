"""Batch-invariant attention over vLLM's paged KV cache (CPU backend), for our model in vLLM.

vLLM's own CPU attention kernel reduces keys in an order that depends on how the step was
scheduled, so a token's logprob in vLLM differs (by ~1e-6) from the trainer's. In
batch-invariant mode our attention backend instead:

1. writes this step's keys and values into the layer's cache memory at the slots vLLM
   assigned (`slot_mapping`);
2. runs the batch-invariant CPU kernel (`titanrl.kernels.cpu_attention`, the one the
   trainer's forward runs) over the cache in place: vLLM's block table tells it where each
   request's keys are, and each request's first query sits at position
   `seq_len - query_len` (the tokens already cached before this step).

A query therefore reduces over the same keys, in the same fixed order, whether it is a decode
step, a prefill, a chunk of a chunked prefill, or a row of a training batch.

Layout: vLLM allocates each layer's CPU cache as `[num_blocks, Hkv, block, 2*D]` and, in this
mode, never reads or writes its contents itself (its attention kernel does not run), so we
store rows token-major: per (block, kv head) `block` key rows of D floats, then `block` value
rows, so every key and value the kernel reads is one contiguous row. The cache must be
float32 (the model's CPU dtype); other dtypes are refused. Block ids, slots and prefix-cache sharing are vLLM's, unchanged.
Anything else that reads the cache bytes (KV offloading or transfer connectors) is not
supported in this mode.
"""

from __future__ import annotations

import torch

from titanrl.kernels.cpu_attention import KeyTable, varlen_attention


def _rows(kv: torch.Tensor, block: torch.Tensor, head: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Row of `kv.view(-1, D)` holding the key of (block, kv head, offset); its value is `bs` rows on."""
    _, H, bs, _ = kv.shape
    return (block * H + head) * (2 * bs) + offset


def _check_layout(kv: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if kv.device.type != "cpu" or kv.dtype != torch.float32:
        raise RuntimeError(
            f"batch-invariant attention in vLLM reads a float32 CPU KV cache, got {kv.dtype} on {kv.device}; "
            "run the model in float32 on CPU, or with batch_invariant=False"
        )
    if kv.dim() != 4 or kv.shape[1] != num_kv_heads or kv.shape[3] != 2 * head_dim or not kv.is_contiguous():
        raise RuntimeError(
            f"batch-invariant attention expects vLLM's CPU KV cache as a contiguous [blocks, {num_kv_heads}, "
            f"block_size, {2 * head_dim}] tensor, got {tuple(kv.shape)}; run with batch_invariant=False here"
        )


def write_kv(kv: torch.Tensor, key_NHD: torch.Tensor, value_NHD: torch.Tensor, slots_N: torch.Tensor) -> None:
    """Stores token n's K/V (token-major rows) at cache slot `slots_N[n]`; negative slots are padding."""
    keep = slots_N >= 0
    key_NHD, value_NHD, slots = key_NHD[keep], value_NHD[keep], slots_N[keep].long()
    _, H, bs, D2 = kv.shape
    rows = _rows(kv, (slots // bs)[:, None], torch.arange(H)[None, :], (slots % bs)[:, None]).flatten()
    flat = kv.view(-1, D2 // 2)
    flat.index_copy_(0, rows, key_NHD.reshape(-1, D2 // 2).to(kv.dtype))
    flat.index_copy_(0, rows + bs, value_NHD.reshape(-1, D2 // 2).to(kv.dtype))


def cache_key_table(kv: torch.Tensor, block_table_RB: torch.Tensor) -> KeyTable:
    """The token-major layout of `write_kv`, described for the kernel to read in place."""
    _, H, bs, D2 = kv.shape
    D = D2 // 2
    return KeyTable(keys=kv, values=kv.view(-1)[bs * D :], table=block_table_RB.long(), block_size=bs,
                    block_stride=H * bs * D2, head_stride=bs * D2, token_stride=D)


def paged_batch_invariant_attention(attn: torch.nn.Module, q_NHD: torch.Tensor, k_NKD: torch.Tensor,
                                    v_NKD: torch.Tensor) -> torch.Tensor:
    """Attention for one layer of a vLLM forward step; `attn` is the layer's vLLM `Attention`.

    q [N, Hq, D], k/v [N, Hkv, D] for the step's N flattened tokens; returns [N, Hq, D].
    """
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    metadata = context.attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(attn.layer_name)
    out = torch.zeros_like(q_NHD)
    if metadata is None:  # vLLM's warm-up/profiling run: nothing is computed
        return out
    kv = attn.kv_cache
    _check_layout(kv, k_NKD.shape[1], k_NKD.shape[2])
    n = int(metadata.num_actual_tokens)
    slot_mapping = context.slot_mapping
    slots = (slot_mapping[attn.layer_name] if isinstance(slot_mapping, dict) else metadata.slot_mapping)[:n]
    write_kv(kv, k_NKD[:n], v_NKD[:n], slots)

    starts = metadata.query_start_loc.long()
    R = starts.shape[0] - 1
    seq_lens = metadata.seq_lens[:R].long()
    query_lens = starts[1:] - starts[:-1]
    # A request's queries are the last `query_len` of its `seq_len` context tokens.
    varlen_attention(q_NHD[:n].to(kv.dtype), cache_key_table(kv, metadata.block_table[:R]), k_NKD.shape[1], starts,
                     seq_lens - query_lens, seq_lens, attn.impl.scale, out=out[:n])
    return out
