"""`rollout.weight_transport='auto'` and the /dev/shm check (`titanrl.driver.weight_transport`).

The free space of /dev/shm is passed in, so each case is decided on the numbers it names; one
test reads this machine's real /dev/shm.
"""

from __future__ import annotations

import pytest

import titanrl
from titanrl.driver.weight_transport import choose_weight_transport, push_bytes, shm_free_bytes
from titanrl.errors import ConfigError
from titanrl.models.hf_checkpoint import load_model
from titanrl.weight_sync.shared_memory import MAX_SEGMENTS

MIB = 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("transport") / "ckpt")


def _config(checkpoint, transport: str = "auto", **run) -> titanrl.RunConfig:
    return titanrl.RunConfig(model=titanrl.ModelConfig(checkpoint=str(checkpoint)),
                             rollout=titanrl.RolloutConfig(weight_transport=transport), **run)


def test_push_bytes_counts_every_parameter_in_the_generator_dtype(checkpoint):
    model, _ = load_model(checkpoint)
    params = sum(p.numel() for p in model.parameters())
    assert push_bytes(_config(checkpoint)) == params * 4  # float32 tiny checkpoint
    half = _config(checkpoint, train=titanrl.TrainConfig(compute=titanrl.ComputeConfig(dtype="bfloat16")))
    assert push_bytes(half) == params * 2


def test_auto_is_shared_memory_on_this_machine_with_room(checkpoint):
    config = _config(checkpoint)
    need = MAX_SEGMENTS * push_bytes(config)
    assert choose_weight_transport(config, "cpu", shm_free=need) == "shared_memory"


def test_auto_falls_back_to_the_object_store(checkpoint):
    config = _config(checkpoint)
    need = MAX_SEGMENTS * push_bytes(config)
    assert choose_weight_transport(config, "cpu", shm_free=need - 1) == "object_store"  # too small
    assert choose_weight_transport(config, "cpu", shm_free=None) == "object_store"  # no /dev/shm
    assert choose_weight_transport(config, "cuda", shm_free=1 << 40) == "object_store"  # engines on GPUs
    joined = _config(checkpoint, ray_address="127.0.0.1:6379")  # nodes may be other machines
    assert choose_weight_transport(joined, "cpu", shm_free=1 << 40) == "object_store"
    unknown = _config(checkpoint.parent / "nowhere")
    assert choose_weight_transport(unknown, "cpu", shm_free=1 << 40) == "object_store"


def test_explicit_transports_are_kept(checkpoint):
    for transport in ("object_store", "shared_memory", "broadcast"):
        assert choose_weight_transport(_config(checkpoint, transport), "cpu", shm_free=1 << 40) == transport


def test_explicit_shared_memory_that_cannot_fit_is_refused_with_the_fix(checkpoint):
    config = _config(checkpoint, "shared_memory")
    with pytest.raises(ConfigError, match=r"--shm-size.*rollout.weight_transport='object_store'"):
        choose_weight_transport(config, "cpu", shm_free=10 * MIB // 1000)


def test_this_machine_reports_its_dev_shm():
    free = shm_free_bytes()
    assert free is None or free > 0
    assert shm_free_bytes("/nonexistent/dir") is None
