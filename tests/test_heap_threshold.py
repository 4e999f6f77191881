"""`train.memory.heap_mmap_threshold_mib`: freed large tensors go back to the kernel instead of staying
in glibc's heap as resident memory no tensor uses (titanrl.memory.set_heap_mmap_threshold)."""

import subprocess
import sys
import textwrap

import pytest

from titanrl.trainer.setup import TrainerSetup

FRAGMENT = textwrap.dedent("""
    import sys, torch
    from titanrl.memory import current_rss_bytes, set_heap_mmap_threshold
    print(set_heap_mmap_threshold(int(sys.argv[1])))
    x = torch.ones(4 << 20); del x  # a freed 16 MiB block: glibc raises its mmap threshold past it
    before = current_rss_bytes()
    blocks, pins = [], []
    for _ in range(8):
        blocks.append(torch.ones(3 << 20))  # 12 MiB each, touched
        pins.append(torch.ones(1 << 14))    # a live allocation after each: the freed blocks are holes
    del blocks
    print((current_rss_bytes() - before) / 2**20)
""")


def _retained_mib(threshold_mib: int) -> tuple[bool, float]:
    """(took effect, MiB still resident after 96 MiB of tensors were freed), in a fresh process
    (the setting is process-wide)."""
    out = subprocess.run([sys.executable, "-c", FRAGMENT, str(threshold_mib)], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_tensors_leave_resident_memory_with_the_threshold_set():
    """With the threshold at 4 MiB, 8 freed 12 MiB tensors between live small ones leave nothing
    resident; with glibc's default (0: not set) some stay resident, which is what the setting is
    for. (How many depends on how far glibc's own threshold has risen, which depends on the
    process's allocation history: 2 of the 8 or all of them were seen on the same machine.)"""
    applied, retained = _retained_mib(4)
    assert applied and retained < 8, retained
    applied_default, retained_default = _retained_mib(0)
    assert not applied_default and retained_default >= 16, retained_default


def test_auto_threshold_follows_the_policys_parameter_count(tmp_path, monkeypatch):
    """train.memory.heap_mmap_threshold_mib=None: 32 MiB for a small policy (its few-MiB activations stay
    in the heap), 1 MiB from LARGE_MODEL_PARAMS parameters on; an explicit value, 0 included, wins.
    A trainer built with the default settles on the small model's value."""
    import torch

    from titanrl.config import MemoryConfig, ModelConfig, TrainConfig
    from titanrl.memory import LARGE_MODEL_PARAMS, auto_heap_mmap_threshold_mib
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer import GRPOTrainer, heap_mmap_threshold_mib

    assert auto_heap_mmap_threshold_mib(LARGE_MODEL_PARAMS - 1) == 32
    assert auto_heap_mmap_threshold_mib(LARGE_MODEL_PARAMS) == 1  # Qwen3-0.6B has ~600M
    auto = TrainConfig()
    assert auto.memory.heap_mmap_threshold_mib is None
    large = [torch.nn.Linear(10_000, 10_000, device="meta")]  # 100M parameters, never allocated
    assert heap_mmap_threshold_mib(auto, large) == 1
    for explicit in (0, 4, 16):
        assert (
            heap_mmap_threshold_mib(TrainConfig(memory=MemoryConfig(heap_mmap_threshold_mib=explicit)), large)
            == explicit
        )

    import titanrl.trainer.trainer as trainer_module

    applied: list[int] = []
    monkeypatch.setattr(trainer_module, "set_heap_mmap_threshold", applied.append)
    small = write_tiny_checkpoint(tmp_path / "small", seed=0)
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(small)), auto, temperature=1.0, seed=0))
    # 1 MiB while the weights load (a large model's value), then the small policy's 32 for its steps.
    assert applied == [1, 32] and heap_mmap_threshold_mib(auto, trainer.pm.parts) == 32
