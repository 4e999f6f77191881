"""A micro-batch's real tokens packed into one row, so the model computes no padding.

The loss keeps its right-padded [B, T] batch (rows are samples: advantages, sequence sums and
masks stay as they are); only the model runs on the packed row. A row's real tokens are those at
or before its last trained target (`moe.real_tokens`): nothing after that can change a trained
logprob, since attention is causal. The LM head then scatters each trained token's logprob back
to its [B, T] slot (see ParallelGRPOStep._head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titanrl.models.packed_sequences import PackedSequences
from titanrl.trainer.moe import real_tokens


@dataclass(frozen=True)
class PackedMicroBatch:
    """Where each token of the packed row [1, N] comes from in the padded batch [B, T]."""

    rows_R: torch.Tensor
    """[R] int64: the padded row of each real token, in packed order (row-major)."""
    cols_R: torch.Tensor
    """[R] int64: its column in that row (also its position: rows start at position 0)."""
    layout: PackedSequences
    """The row's sequences: one per sample with a trained token, then (only where the row's
    length must be a multiple, sequence parallelism) one filler sequence of `filler` tokens."""
    filler: int
    """Tokens appended after the real ones to reach the length multiple (no loss, no gradient)."""

    @property
    def positions_1N(self) -> torch.Tensor:
        return self.layout.position_of_token[None]

    def gather(self, t_BT: torch.Tensor) -> torch.Tensor:
        """A per-token tensor [B, T, ...] in the packed layout [1, N, ...] (filler slots zero)."""
        real = t_BT[self.rows_R, self.cols_R]
        if self.filler:
            real = torch.cat([real, real.new_zeros((self.filler, *real.shape[1:]))])
        return real[None]


def pack_micro_batch(loss_mask_BT: torch.Tensor, multiple: int = 1) -> PackedMicroBatch | None:
    """The packed layout of a micro-batch's real tokens, or None when no row has a trained token."""
    real_BT = real_tokens(loss_mask_BT)
    lengths = real_BT.sum(1)
    if not bool(lengths.any()):
        return None
    rows_R, cols_R = real_BT.nonzero(as_tuple=True)  # row-major: each sample's tokens in order
    R = rows_R.numel()
    filler = -R % multiple
    seq_lengths = [int(n) for n in lengths.tolist() if n > 0] + ([filler] if filler else [])
    return PackedMicroBatch(rows_R, cols_R, PackedSequences.from_lengths(seq_lengths, loss_mask_BT.device), filler)


def pad_fraction(loss_mask_BT: torch.Tensor, micro_batch_rows: int) -> float:
    """The share of the token slots a right-padded forward computes that are not real tokens,
    with micro-batches of `micro_batch_rows` rows each trimmed to its last trained target (what
    the trainer computes with `train.pack_sequences` off)."""
    real = computed = 0
    for lo in range(0, loss_mask_BT.shape[0], micro_batch_rows):
        part = loss_mask_BT[lo:lo + micro_batch_rows]
        r = real_tokens(part)
        real += int(r.sum())
        computed += part.shape[0] * (int(r.any(0).nonzero().max()) + 1 if r.any() else 1)
    return 1.0 - real / max(1, computed)
