"""train.compute.pack_sequences: the trainer computes only real tokens, with the padded step's gradients.

Each case runs one trainer with packing and one without on the same batch and compares the
gradients of every parameter (and, where the claim is exact, the logprobs bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from titanrl.models.tiny import write_tiny_checkpoint, write_tiny_moe_checkpoint
from titanrl.trainer.packing import pack_micro_batch, pad_fraction
from titanrl.config import MemoryConfig, MoeConfig

from support.packing_cases import accumulated_gradients, assert_same_gradients, varied_groups


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared_prompts"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_packed_step_has_the_padded_gradients_and_computes_only_real_tokens(checkpoint, batch_invariant, share):
    groups = varied_groups()
    g_pad, s_pad, lp_pad, computed_pad, batch = accumulated_gradients(checkpoint, groups, False, batch_invariant)
    g_pack, s_pack, lp_pack, computed_pack, _ = accumulated_gradients(checkpoint, groups, True, batch_invariant, share)
    assert_same_gradients(g_pack, g_pad)
    assert s_pack.tokens == s_pad.tokens
    assert s_pack.loss_sum == pytest.approx(s_pad.loss_sum, rel=1e-6)
    if batch_invariant:  # what parity with a batch-invariant generator rests on
        assert torch.equal(lp_pack, lp_pad)
    else:
        torch.testing.assert_close(lp_pack, lp_pad, rtol=1e-5, atol=1e-6)
    # Real tokens: up to each row's last trained target (a group's prompt once, when shared);
    # the padded step computes more.
    micro_batches = [(batch.loss_mask_BT[lo:lo + 5], batch.input_ids_BT[lo:lo + 5]) for lo in range(0, 12, 5)]
    real = sum(int(pack_micro_batch(mask).rows_R.numel()) for mask, _ in micro_batches)
    shared = sum(pack_micro_batch(mask, 1, ids).shared_slots for mask, ids in micro_batches)
    assert shared > 0
    assert computed_pack == (real - shared if share else real)
    assert computed_pad > computed_pack


def test_packed_step_with_activation_checkpointing(checkpoint):
    """The layout stays set through the backward, where checkpointed blocks recompute attention."""
    groups = varied_groups(seed=1)
    g_pad, *_ = accumulated_gradients(checkpoint, groups, False, memory=MemoryConfig(activation_checkpointing="full"))
    g_pack, *_ = accumulated_gradients(checkpoint, groups, True, memory=MemoryConfig(activation_checkpointing="full"))
    assert_same_gradients(g_pack, g_pad)


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared_prompts"])
def test_packed_moe_step_with_router_replay_and_aux_loss(tmp_path, share):
    """The auxiliary loss and routing counts weigh a shared prompt token once per sample holding it."""
    ckpt = write_tiny_moe_checkpoint(tmp_path / "moe", seed=0)
    groups = varied_groups(seed=2, routed_layers=2)  # a group's tokens are all routed alike: prompts shared
    kw = dict(moe=MoeConfig(router_replay=True, load_balance="aux_loss"))
    g_pad, s_pad, *_ = accumulated_gradients(ckpt, groups, False, **kw)
    g_pack, s_pack, *_ = accumulated_gradients(ckpt, groups, True, share=share, **kw)
    assert_same_gradients(g_pack, g_pad)
    assert s_pack.moe is not None and s_pad.moe is not None
    torch.testing.assert_close(torch.tensor(s_pack.moe.aux_loss), torch.tensor(s_pad.moe.aux_loss))


def test_pack_micro_batch_layout_and_filler():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0.]])
    packed = pack_micro_batch(mask, multiple=4)
    assert packed.rows_R.tolist() == [0, 0, 0, 2] and packed.cols_R.tolist() == [0, 1, 2, 0]
    assert packed.filler == 0 and packed.layout.cu_seqlens.tolist() == [0, 3, 4]
    packed = pack_micro_batch(mask, multiple=3)
    assert packed.filler == 2 and packed.layout.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.gather(torch.arange(15).view(3, 5)).tolist() == [[0, 1, 2, 10, 0, 0]]
    assert pack_micro_batch(torch.zeros(2, 3)) is None
    # Row 0 computes 3 slots for 3 real tokens, row 1 none, row 2 (same micro-batch) 3 for 1.
    assert pad_fraction(mask, micro_batch_rows=3) == pytest.approx(1 - 4 / 9)


def test_pack_micro_batch_shares_a_prompt_once():
    """Rows 0 and 2 start with the same prompt up to their first trained position (column 2):
    row 2 keeps only its completion and reads the prompt's keys from row 0's tokens."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 1, 2, 0], [5, 6, 7, 3, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 0.]])
    packed = pack_micro_batch(mask, 1, ids)
    assert packed.rows_R.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert packed.cols_R.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 3]
    assert packed.shared_slots == 3
    # Row 2's column 3 is its own token (the 9th); its prompt slots are row 0's tokens 0-2.
    assert packed.slot_token_S.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 8]
    layout = packed.layout
    assert layout.sequence_of_token.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert layout.position_of_token.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 3]
    assert layout.shared_token_E.tolist() == [0, 1, 2] and layout.shared_sequence_E.tolist() == [2, 2, 2]
    assert layout.shared_position_E.tolist() == [0, 1, 2] and layout.max_len == 4
    assert packed.slots_per_token().tolist() == [[2, 2, 2, 1, 1, 1, 1, 1, 1]]
    # A different key (e.g. other routed experts) keeps the rows apart.
    keys = torch.arange(15).view(3, 5)
    assert pack_micro_batch(mask, 1, ids, keys).shared_slots == 0
    # A row whose only trained slot is its first one shares everything: no sequence of its own.
    mask[2] = torch.tensor([0, 0, 1, 0, 0.])
    packed = pack_micro_batch(mask, 2, ids)
    assert packed.rows_R.numel() == 8 and packed.filler == 0 and packed.layout.num_sequences == 2
    assert packed.slot_token_S.tolist()[-3:] == [0, 1, 2] and not packed.layout.shares_prefixes
