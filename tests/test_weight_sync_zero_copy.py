"""Zero-copy shared-memory loads (WeightSyncPlan.zero_copy): Parameters become views of the
segment the sender wrote, the segment stays reserved while they view it, and nothing a receiver
writes in place ever lands in memory other receivers map.

Real segments in /dev/shm, a real SharedMemorySender and the receiver's `load_from_segment`, on a
small nn.Module (the vLLM engine path is covered by tests/test_weight_sync.py, whose plans load
zero-copy by default).
"""

import torch
from torch import nn

from titanrl.models.common.vllm_kernels import stacked_rows
from titanrl.weight_sync import TensorsWeights
from titanrl.weight_sync.shared_memory import SegmentCache, SharedMemorySender, load_from_segment
from titanrl.weight_sync.target import ParameterTarget


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4, bias=False)).to(dtype)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=g) for name, p in _model().named_parameters()}


class Receiver:
    """One receiver's state: its model, target and segment cache."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.target, self.cache = model, ParameterTarget(model), SegmentCache()

    def load(self, sender: SharedMemorySender, version: int, weights: dict, zero_copy: bool = True):
        source = TensorsWeights(weights)
        ann = sender.publish(version, source)
        sender.send(version, source)
        self.counts = load_from_segment(self.target, ann, 1, self.cache, zero_copy=zero_copy)
        return self.cache.segments[sender.sender_id][ann.segment]  # this receiver's mapping of it

    def holds(self, weights: dict) -> bool:
        return all(torch.equal(p.detach().float(), weights[n]) for n, p in self.model.named_parameters())


def test_zero_copy_parameters_view_the_segment_which_stays_reserved_until_replaced():
    """The load copies nothing: every Parameter's memory is in the segment. The sender cannot
    rewrite that segment while they are (the next version goes elsewhere, the receiver's values
    do not move when it is written), and may once the next version replaced them."""
    sender, rx = SharedMemorySender(num_receivers=1, timeout_s=10), Receiver(_model())
    v1, v2, v3 = _weights(1), _weights(2), _weights(3)
    try:
        seg1 = rx.load(sender, 1, v1)
        assert rx.holds(v1)
        assert rx.counts == (3, 3)  # (loaded, adopted as views): both Linear weights and the bias
        assert all(seg1.holds(p) for p in rx.model.parameters())
        assert not seg1.is_free()  # pinned by the views

        seg2 = rx.load(sender, 2, v2)
        assert seg2 is not seg1
        assert rx.holds(v2) and all(seg2.holds(p) for p in rx.model.parameters())
        assert seg1.is_free() and not seg2.is_free()  # v1's views are gone: its segment is released

        source = TensorsWeights(v3)
        ann3 = sender.publish(3, source)
        sender.send(3, source)
        assert ann3.segment == seg1.name  # the released segment is reused ...
        assert rx.holds(v2)  # ... and writing v3 into it left the running weights alone
        load_from_segment(rx.target, ann3, 1, rx.cache, zero_copy=True)
        assert rx.holds(v3) and all(seg1.holds(p) for p in rx.model.parameters())
    finally:
        rx.cache.close(params=rx.target.tensors())
        sender.close()


def test_without_zero_copy_every_parameter_is_copied_and_the_segment_released():
    sender, rx = SharedMemorySender(num_receivers=1, timeout_s=10), Receiver(_model())
    try:
        seg = rx.load(sender, 1, _weights(1), zero_copy=False)
        assert rx.holds(_weights(1))
        assert not any(seg.holds(p) for p in rx.model.parameters())
        assert seg.is_free()
    finally:
        rx.cache.close()
        sender.close()


def test_parameters_of_another_dtype_are_cast_into_memory_of_their_own():
    """A bfloat16 engine receiving float32 weights: nothing to view, every tensor is cast and copied."""
    sender, rx = SharedMemorySender(num_receivers=1, timeout_s=10), Receiver(_model(torch.bfloat16))
    v1 = _weights(1)
    try:
        seg = rx.load(sender, 1, v1)
        assert all(p.dtype == torch.bfloat16 for p in rx.model.parameters())
        assert all(torch.equal(p, v1[n].to(torch.bfloat16)) for n, p in rx.model.named_parameters())
        assert not any(seg.holds(p) for p in rx.model.parameters())
        assert seg.is_free()
    finally:
        rx.cache.close()
        sender.close()


def test_in_place_writers_and_close_first_move_parameters_out_of_the_segment():
    """make_private (before load_weights or a broadcast writes in place) and close keep the values,
    give every Parameter memory of its own and release the segment; a later in-place write then
    leaves the segment's bytes (which other receivers view) untouched."""
    sender, rx = SharedMemorySender(num_receivers=1, timeout_s=10), Receiver(_model())
    v1 = _weights(1)
    try:
        seg = rx.load(sender, 1, v1)
        snapshot = seg.data.clone()
        assert rx.cache.make_private(rx.target.tensors()) == len(v1)
        assert rx.holds(v1) and seg.is_free()
        assert not any(seg.holds(p) for p in rx.model.parameters())
        with torch.no_grad():
            for p in rx.model.parameters():
                p.add_(1.0)
        assert torch.equal(seg.data, snapshot)

        seg2 = rx.load(sender, 2, _weights(2))
        rx.cache.close(params=rx.target.tensors())
        assert rx.holds(_weights(2)) and not any(seg2.holds(p) for p in rx.model.parameters())
        assert rx.cache.pinned == {}
    finally:
        rx.cache.close()
        sender.close()


def test_stacked_rows_is_a_view_when_the_weights_lie_back_to_back():
    """q/k/v (or gate/up) that a zero-copy push left adjacent in one segment stack without a copy;
    weights elsewhere are concatenated. Both equal torch.cat."""
    flat = torch.arange(64, dtype=torch.float32)
    q, k, v = flat[:16].view(4, 4), flat[16:24].view(2, 4), flat[24:32].view(2, 4)
    stacked = stacked_rows([q, k, v])
    assert torch.equal(stacked, torch.cat([q, k, v])) and stacked.data_ptr() == q.data_ptr()
    apart = stacked_rows([q, flat[40:48].view(2, 4)])
    assert torch.equal(apart, torch.cat([q, flat[40:48].view(2, 4)])) and apart.data_ptr() != q.data_ptr()
    separate = [torch.randn(2, 4), torch.randn(3, 4)]
    assert torch.equal(stacked_rows(separate), torch.cat(separate))


def test_written_segments_leave_the_senders_resident_memory_and_keep_their_data():
    """After a push of 64 MiB, the sender's resident memory holds none of the segment (the pages
    stay in /dev/shm: a process that maps the segment reads the pushed values)."""
    from titanrl.memory import current_rss_bytes
    from titanrl.weight_sync.segment import Segment

    weights = {"w": torch.randn(16 << 20, generator=torch.Generator().manual_seed(0))}  # 64 MiB of float32
    sender = SharedMemorySender(num_receivers=1, timeout_s=10)
    try:
        source = TensorsWeights(weights)
        before = current_rss_bytes()
        ann = sender.publish(1, source)
        sender.send(1, source)
        grown = current_rss_bytes() - before
        assert grown < 8 << 20, f"the sender kept {grown / 2**20:.0f} MiB of the segment resident"
        seg = Segment.attach(ann.segment)
        try:
            assert torch.equal(seg.data.view(torch.float32), weights["w"])
        finally:
            seg.close()
    finally:
        sender.close()
