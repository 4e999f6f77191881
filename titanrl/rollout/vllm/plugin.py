"""vLLM plugin: registers our Qwen3 under `TitanRLQwen3ForCausalLM` in vLLM's ModelRegistry.

vLLM calls `register()` in every process it starts (driver, engine core, workers) through
the `vllm.general_plugins` entry point declared in pyproject.toml; a registration made only
in the driver is invisible to spawned engine processes. `VllmEngine` also calls it directly,
so the in-process engine works even without the package installed.
"""

from __future__ import annotations

ARCHITECTURE = "TitanRLQwen3ForCausalLM"
"""The architecture name our model class is registered under."""
BATCH_INVARIANT_KEY = "titanrl_batch_invariant"
"""HF-config key (set through `hf_overrides`) that builds the model in batch-invariant mode;
it reaches spawned engine processes with the rest of the config."""


def register() -> None:
    """Registers the architecture with vLLM; safe to call any number of times."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    from titanrl.rollout.vllm.model import TitanQwen3ForVLLM

    ModelRegistry.register_model(ARCHITECTURE, TitanQwen3ForVLLM)
