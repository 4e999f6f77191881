"""Shared pytest fixtures."""

import os

import pytest

# vLLM on CPU: no hub, a small KV cache, one OpenMP thread (robust when cores are shared).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


# --- vLLM rollout engine ----------------------------------------------------------------
VLLM_TINY_OVERRIDES = dict(seed=3, std=0.1)
"""std 0.1 (not the 0.02 default) makes next-token distributions peaked enough that weight
changes move logprobs measurably and greedy decoding is not a coin toss between near-ties."""


@pytest.fixture(scope="session")
def vllm_tiny_checkpoint(tmp_path_factory):
    """A tiny tied-embedding Qwen3 checkpoint directory shared by the vLLM tests."""
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("vllm_ckpt") / "ckpt", **VLLM_TINY_OVERRIDES)


@pytest.fixture(scope="session")
def vllm_engine(vllm_tiny_checkpoint):
    """One in-process VllmEngine on `vllm_tiny_checkpoint` for the whole session (~5-15 s start).

    Tests that push weights must push the checkpoint's weights back before returning.
    """
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(VllmEngineConfig(checkpoint=str(vllm_tiny_checkpoint), max_model_len=256, max_num_seqs=32))
    yield engine
    engine.close()


# --- Ray ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance (loopback only) shared by every test that starts actors."""
    import ray

    from titanrl.driver.ray_runtime import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()


# --- hardware markers --------------------------------------------------------------------
def pytest_collection_modifyitems(config, items):
    """`gpu`/`tpu` tests skip (visibly, with the reason) where that hardware is absent.

    Tests marked `own_vllm_engine` start and close a private in-process vLLM engine. Closing
    one tears down vLLM's process-wide state (its torch.distributed groups), which would break
    the session's shared `vllm_engine`, so they run first, before that engine exists.
    """
    items.sort(key=lambda item: 0 if "own_vllm_engine" in item.keywords else 1)
    import importlib.util

    import torch

    has_gpu = torch.cuda.is_available()
    has_xla = importlib.util.find_spec("torch_xla") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "tpu" in item.keywords and not has_xla:
            item.add_marker(pytest.mark.skip(reason="needs torch_xla"))
