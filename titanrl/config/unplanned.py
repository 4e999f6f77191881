"""What an `auto` memory setting means where no memory plan resolved it.

`titanrl.train` resolves every `auto` from the run's memory plan before any actor starts
(titanrl/planning/fit.py). A trainer step or a vLLM engine built by hand (tests, benchmarks,
`titanrl.trainer` used as a library) has no plan: it takes the fast settings below, the
defaults these fields had before they could be planned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from titanrl.config.schema import EngineConfig, MemoryConfig, TrainConfig

UNPLANNED_MICRO_BATCH_SIZE = 64
UNPLANNED_ACTIVATION_CHECKPOINTING = "none"
UNPLANNED_KV_CACHE_GIB = 1.0
UNPLANNED_VLLM_KERNELS = True


def _with_unplanned(section: Any, unplanned: dict[str, Any]) -> Any:
    """`section` with each field of `unplanned` that is 'auto' set to its value (the same object
    when none is)."""
    changes = {name: value for name, value in unplanned.items() if getattr(section, name) == "auto"}
    return dataclasses.replace(section, **changes) if changes else section


def concrete_memory(memory: MemoryConfig) -> MemoryConfig:
    """`memory` with each 'auto' replaced by its unplanned value."""
    return _with_unplanned(memory, {"micro_batch_size": UNPLANNED_MICRO_BATCH_SIZE,
                                    "activation_checkpointing": UNPLANNED_ACTIVATION_CHECKPOINTING})


def concrete_train(train: TrainConfig) -> TrainConfig:
    """`train` with its memory section made concrete (`concrete_memory`)."""
    memory = concrete_memory(train.memory)
    return train if memory is train.memory else dataclasses.replace(train, memory=memory)


def concrete_engine(engine: EngineConfig) -> EngineConfig:
    """`engine` with an 'auto' KV cache and kernel choice replaced by their unplanned values."""
    return _with_unplanned(engine, {"kv_cache_gib": UNPLANNED_KV_CACHE_GIB, "vllm_kernels": UNPLANNED_VLLM_KERNELS})
