"""An object-store announcement carries its tensors' bytes out of band (no in-memory copy)."""

from __future__ import annotations

import pickle

import torch

from titanrl.weight_sync.announcement import WeightAnnouncement
from titanrl.weight_sync.layout import build_layout


def _announcement() -> tuple[WeightAnnouncement, dict[str, torch.Tensor]]:
    tensors = {"w": torch.randn(512, 256), "norm": torch.randn(7).to(torch.bfloat16), "scalar": torch.tensor(3.0)}
    layout = build_layout([(n, t.shape, t.dtype) for n, t in tensors.items()])
    return WeightAnnouncement("object_store", 4, layout, tensors=tensors), tensors


def test_tensor_bytes_travel_as_out_of_band_buffers_and_come_back_equal() -> None:
    ann, tensors = _announcement()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(ann, protocol=5, buffer_callback=buffers.append)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert sum(memoryview(b).nbytes for b in buffers) == nbytes
    assert len(data) < 4096  # only names, shapes, dtypes and the layout are pickled in band
    back = pickle.loads(data, buffers=buffers)
    assert back.version == 4 and back.layout == ann.layout
    for name, t in tensors.items():
        got = back.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_a_plain_tensor_dict_would_be_copied_in_band() -> None:
    """The control: torch's own pickling puts every byte in the pickle itself."""
    _, tensors = _announcement()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(tensors, protocol=5, buffer_callback=buffers.append)
    assert len(data) > 512 * 256 * 4 and not buffers
