"""The XLA suite: runs under the XLA venv's own pytest (`.venv-xla/bin/python -m pytest tests/xla`).

XLA's CPU device with four devices (the SPMD tests shard over them), set before torch_xla is
imported; SPMD mode is switched on once, before any tensor reaches the device, because the XLA
trainer drives every layout (one device or a mesh) as one SPMD program.
"""

import importlib.util
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

if importlib.util.find_spec("torch_xla") is None:
    collect_ignore_glob = ["test_*.py"]  # not the XLA venv: nothing here can run
else:
    import pytest
    import torch
    import torch_xla.runtime as xr

    xr.use_spmd()
    # torch's autograd engine sizes its per-device queues at its first backward, from the device
    # count torch_xla reports then: 0 until the runtime starts. A CPU reference trainer's backward
    # before any XLA tensor existed left no queue for the XLA device, and the first XLA backward
    # failed an internal assert (test_xla_spmd.py run alone). Starting the runtime here avoids it;
    # the trainer's XlaRuntime starts it before any backward too.
    xr.global_runtime_device_count()

    @pytest.fixture(scope="session")
    def tiny_ckpt(tmp_path_factory):
        """A tiny dense Qwen3 checkpoint (float32) shared by the XLA tests."""
        from titanrl.models.tiny import write_tiny_checkpoint

        from helpers import TINY

        return write_tiny_checkpoint(tmp_path_factory.mktemp("xla") / "ckpt", seed=3, std=0.1, **TINY)

    @pytest.fixture(autouse=True)
    def _seeded():
        torch.manual_seed(0)
