"""A micro-batch's real tokens packed into one row, so the model computes no padding.

The loss keeps its right-padded [B, T] batch (rows are samples: advantages, sequence sums and
masks stay as they are); only the model runs on the packed row. A row's real tokens are those at
or before its last trained target (`moe.real_tokens`): nothing after that can change a trained
logprob, since attention is causal. The LM head then scatters each trained token's logprob back
to its [B, T] slot (see GRPOStep._head).

With `input_ids_BT`, rows that begin with the same prompt (a GRPO group's samples) hold it once:
a row's prefix up to and including its first trained position is shared when an earlier row of
the micro-batch has the same tokens there. Those hidden states are equal in both rows (causal
attention), so the later row keeps only its own tokens; attention reads the prefix's keys from
the earlier row (`PackedSequences.shared_*`) and the head reads its first target's hidden state
there. On the arithmetic example (8 samples of ~60-token prompts and completions) that is about
40 % fewer tokens through every projection and MLP.
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
    """[R] int64: the padded row of each packed real token, in packed order (row-major)."""
    cols_R: torch.Tensor
    """[R] int64: its column in that row (also its position: rows start at position 0)."""
    layout: PackedSequences
    """The row's sequences: one per sample with a packed token, then (only where the row's
    length must be a multiple, sequence parallelism) one filler sequence of `filler` tokens."""
    filler: int
    """Tokens appended after the real ones to reach the length multiple (no loss, no gradient)."""
    slot_rows_S: torch.Tensor
    """[S] int64: every real slot of the padded batch (row-major), shared prefixes included ..."""
    slot_cols_S: torch.Tensor
    """[S] int64: ... its column ..."""
    slot_token_S: torch.Tensor
    """[S] int64: ... and the packed token whose hidden state it has (its own, or the token of the
    earlier row it shares its prefix with). Without shared prefixes: the packed order itself."""

    @property
    def shared_slots(self) -> int:
        """Real slots the packed row does not compute (they share an earlier row's prefix)."""
        return self.slot_rows_S.numel() - self.rows_R.numel()

    def slots_per_token(self) -> torch.Tensor:
        """[1, N] float: how many real slots each packed token stands for (1, more for a shared
        prefix, 0 for filler): per-token weights that count the batch as the padded step does."""
        counts = torch.zeros(self.rows_R.numel() + self.filler, device=self.slot_token_S.device)
        return counts.index_add(0, self.slot_token_S, torch.ones_like(self.slot_token_S, dtype=counts.dtype))[None]

    @property
    def positions_1N(self) -> torch.Tensor:
        return self.layout.position_of_token[None]

    def gather(self, t_BT: torch.Tensor) -> torch.Tensor:
        """A per-token tensor [B, T, ...] in the packed layout [1, N, ...] (filler slots zero)."""
        real = t_BT[self.rows_R, self.cols_R]
        if self.filler:
            real = torch.cat([real, real.new_zeros((self.filler, *real.shape[1:]))])
        return real[None]


def pack_micro_batch(loss_mask_BT: torch.Tensor, multiple: int = 1, input_ids_BT: torch.Tensor | None = None,
                     prefix_key_BT: torch.Tensor | None = None) -> PackedMicroBatch | None:
    """The packed layout of a micro-batch's real tokens, or None when no row has a trained token.

    `input_ids_BT`: share prompts (see the module docstring). `prefix_key_BT`: more per-token
    data [B, T, ...] that must also be equal for two rows to share a prefix (e.g. the experts the
    generator routed each token to, which router replay makes the trainer's).
    """
    real_BT = real_tokens(loss_mask_BT)
    lengths = real_BT.sum(1)
    if not bool(lengths.any()):
        return None
    device = loss_mask_BT.device
    own_BT = real_BT
    owner_of_row: dict[int, tuple[int, int]] = {}
    """Sharing row -> (row whose prefix it shares, last shared column)."""
    if input_ids_BT is not None:
        own_BT, owner_of_row = _share_prefixes(loss_mask_BT, real_BT, input_ids_BT, prefix_key_BT)
    rows_R, cols_R = own_BT.nonzero(as_tuple=True)  # row-major: each sample's tokens in order
    R = rows_R.numel()
    filler = -R % multiple
    slot_rows_S, slot_cols_S = real_BT.nonzero(as_tuple=True)
    if not owner_of_row:
        seq_lengths = [int(n) for n in lengths.tolist() if n > 0] + ([filler] if filler else [])
        layout = PackedSequences.from_lengths(seq_lengths, device)
        return PackedMicroBatch(rows_R, cols_R, layout, filler, slot_rows_S, slot_cols_S,
                                torch.arange(R, device=device))
    token_BT = torch.full(real_BT.shape, -1, dtype=torch.long, device=device)
    token_BT[rows_R, cols_R] = torch.arange(R, device=device)
    own_lengths_B = own_BT.sum(1)
    # Rows with no token of their own (a one-token completion sharing its prompt) get no sequence.
    sequence_of_row_B = torch.cumsum(own_lengths_B > 0, 0) - 1
    S = int((own_lengths_B > 0).sum())
    copies: list[tuple[torch.Tensor, int]] = []
    """(the owner's packed tokens of the shared prefix, the sequence that reads them)."""
    for row, (owner, last) in owner_of_row.items():
        token_BT[row, :last + 1] = token_BT[owner, :last + 1]
        if own_lengths_B[row] > 0:  # a row with a token of its own attends to the prefix's keys
            copies.append((token_BT[owner, :last + 1], int(sequence_of_row_B[row])))
    sequence_N = torch.cat([sequence_of_row_B[rows_R], torch.full((filler,), S, dtype=torch.long, device=device)])
    own_lengths = own_lengths_B.tolist()
    position_N = torch.cat([cols_R, torch.arange(filler, device=device)])
    cu = torch.zeros(S + 1 + bool(filler), dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor([n for n in own_lengths if n] + ([filler] if filler else []),
                                       device=device), 0)
    layout = PackedSequences(
        sequence_N, position_N, cu, max(int(lengths.max()), filler),
        shared_token_E=torch.cat([t for t, _ in copies]) if copies else None,
        shared_sequence_E=torch.cat([torch.full_like(t, s) for t, s in copies]) if copies else None,
        shared_position_E=torch.cat([torch.arange(t.numel(), device=device) for t, _ in copies]) if copies else None)
    return PackedMicroBatch(rows_R, cols_R, layout, filler, slot_rows_S, slot_cols_S,
                            token_BT[slot_rows_S, slot_cols_S])


def _share_prefixes(loss_mask_BT: torch.Tensor, real_BT: torch.Tensor, input_ids_BT: torch.Tensor,
                    prefix_key_BT: torch.Tensor | None) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
    """Which real tokens each row computes itself (bool [B, T]), and for each row that shares its
    prefix, (the earliest row with the same prefix, the prefix's last column): the prefix runs up
    to and including the row's first trained position, whose hidden state predicts its first target."""
    trained_BT = loss_mask_BT > 0
    first_trained = trained_BT.int().argmax(1).tolist()
    has_trained = trained_BT.any(1).tolist()
    ids = input_ids_BT.tolist()
    keys = None if prefix_key_BT is None else prefix_key_BT.reshape(*prefix_key_BT.shape[:2], -1)
    first_row_of: dict[tuple, int] = {}
    owner_of_row: dict[int, tuple[int, int]] = {}
    own_BT = real_BT.clone()
    for row, last in enumerate(first_trained):
        if not has_trained[row]:
            continue
        key = (last, *ids[row][:last + 1])
        if keys is not None:
            key += tuple(keys[row, :last + 1].reshape(-1).tolist())
        owner = first_row_of.setdefault(key, row)
        if owner != row:
            owner_of_row[row] = (owner, last)
            own_BT[row, :last + 1] = False
    return own_BT, owner_of_row


def pad_fraction(loss_mask_BT: torch.Tensor, micro_batch_rows: int) -> float:
    """The share of the token slots a right-padded forward computes that are not real tokens,
    with micro-batches of `micro_batch_rows` rows each trimmed to its last trained target (what
    the trainer computes with `train.compute.pack_sequences` off)."""
    real = computed = 0
    for lo in range(0, loss_mask_BT.shape[0], micro_batch_rows):
        part = loss_mask_BT[lo:lo + micro_batch_rows]
        r = real_tokens(part)
        real += int(r.sum())
        computed += part.shape[0] * (int(r.any(0).nonzero().max()) + 1 if r.any() else 1)
    return 1.0 - real / max(1, computed)
