"""vLLM plugin: registers our Qwen3 under `TitanRLQwen3ForCausalLM` in vLLM's ModelRegistry.

vLLM calls `register()` in every process it starts (driver, engine core, workers) through
the `vllm.general_plugins` entry point declared in pyproject.toml; a registration made only
in the driver is invisible to spawned engine processes. `VllmEngine` also calls it directly,
so the in-process engine works even without the package installed.

The model is registered by its `module:class` name, so this module does not import it (nor
vLLM's model code with it); vLLM imports it when it builds the model.
"""

from __future__ import annotations

from titanrl.rollout.vllm.names import ARCHITECTURE

MODEL_CLASS = "titanrl.rollout.vllm.model:TitanQwen3ForVLLM"
"""Our model class, as `module:class` for `ModelRegistry.register_model`'s lazy registration."""


def register() -> None:
    """Registers the architecture with vLLM; safe to call any number of times."""
    from vllm import ModelRegistry

    if ARCHITECTURE in ModelRegistry.get_supported_archs():
        return
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
