"""Shared pytest fixtures."""

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# vLLM on CPU: no hub, a small KV cache, one OpenMP thread (robust when cores are shared).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM keeps what it inspected of a model class in VLLM_CACHE_ROOT/modelinfos, one file per class
# name holding the hash of its module: checkouts with different titanrl/rollout/vllm/model.py on
# one machine overwrite each other's file, and each engine start after such a miss inspects the
# class in a subprocess of its own (+10-15 s on 2 busy cores). One cache per checkout stays warm.
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(__file__).resolve().parents[1] / ".cache" / "vllm"))

# The batch-invariant kernels run in this process and in processes it starts (gloo worlds, vLLM
# engines, Ray actors): on AVX-512 CPUs MKL must take its strict AVX2 mode before any test's
# first matmul, and children read it from the environment (see titanrl.kernels.mkl_mode).
from titanrl.config import EngineConfig
from titanrl.kernels.mkl_mode import actor_env, ensure_strict_mkl  # noqa: E402

os.environ.update(actor_env())
ensure_strict_mkl()

# tests/xla runs under the XLA venv's own pytest (`make test-xla`), never in the main suite.
collect_ignore = [] if importlib.util.find_spec("torch_xla") is not None else ["xla"]


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

    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=str(vllm_tiny_checkpoint), settings=EngineConfig(max_model_len=256, max_num_seqs=32)
        )
    )
    yield engine
    engine.close()


VLLM_TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
"""The tiny Qwen3-MoE of the vLLM tests: 4 experts, top-2, both layers sparse, the dense tiny model's
attention (head_dim 32) and byte tokenizer. init std 0.1 gives router scores of std ~1, so tokens
spread over all experts and top-2 differs from token to token."""


@pytest.fixture(scope="session")
def vllm_moe_checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint directory (per-expert tensor names, as the Hub's) for the vLLM tests."""
    import dataclasses

    from titanrl.models.qwen3.moe import Qwen3MoeConfig
    from titanrl.models.tiny import tiny_config, write_checkpoint

    config = Qwen3MoeConfig(**{**dataclasses.asdict(tiny_config()), **VLLM_TINY_MOE})
    return write_checkpoint(tmp_path_factory.mktemp("vllm_moe_ckpt") / "ckpt", config, seed=3, std=0.1)


@pytest.fixture(scope="session")
def vllm_moe_engine(vllm_moe_checkpoint):
    """One in-process VllmEngine on `vllm_moe_checkpoint`, recording routing, started by the first
    test that asks for it. Tests that push weights must push the checkpoint's weights back."""
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=str(vllm_moe_checkpoint),
            settings=EngineConfig(max_model_len=512, max_num_seqs=32, record_routed_experts=True),
        )
    )
    yield engine
    engine.close()


# --- the tiny arithmetic run the end-to-end tests train ---------------------------------
def digit_share(prompt: str, completion: str, **fields: Any) -> float:
    """Fraction of completion characters that are digits: varies across samples of a random model."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


@dataclass(frozen=True)
class TinyRun:
    """Inputs of a small real training run: a tiny checkpoint, `{i}+{i%7}=` rows and a reward."""

    checkpoint: Path
    """A tiny tied-embedding Qwen3 HF checkpoint (seed 5, init std 0.1); read only, never written."""
    rows: list[dict[str, Any]]
    """40 rows `{"prompt": "i+(i%7)=", "answer": "<sum>"}`."""
    train_file: Path
    """`rows` as a JSON-lines file (data.train_file)."""
    reward: Any = digit_share
    """The reward the runs train on (`digit_share`; rewards get the row's `answer` and ignore it)."""

    def eval_file(self, n: int) -> Path:
        """The first `n` rows as a JSON-lines file (data.eval_file), written on first use."""
        from titanrl.data import write_rows

        path = self.train_file.with_name(f"eval_{n}.jsonl")
        if not path.exists():
            write_rows(path, self.rows[:n])
        return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """The checkpoint, rows and reward shared by the end-to-end run tests (written once a session)."""
    from titanrl.data import write_rows
    from titanrl.models.tiny import write_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_run")
    rows = [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(40)]
    write_rows(folder / "train.jsonl", rows)
    # The embedding is padded past the tokenizer's 259 ids, as Qwen's 151,936 rows are: every run
    # test also shows that ids without a token generate, score and train without errors.
    ckpt = write_tiny_checkpoint(folder / "ckpt", seed=5, std=0.1, vocab_size=320)
    return TinyRun(ckpt, rows, folder / "train.jsonl")


# --- torch.distributed --------------------------------------------------------------------
@pytest.fixture(scope="session")
def gloo_world():
    """One 2-rank gloo world (tests/gloo_world.py) that the 2-process test files share: their
    world functions run in it one after another, instead of each file starting its own (~10 s)."""
    from gloo_world import GlooWorld

    world = GlooWorld(world_size=2)
    yield world
    world.close()


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
