"""vLLM plugin: registers our Qwen3 and Qwen3-MoE in vLLM's ModelRegistry under our own names.

vLLM calls `register()` in every process it starts (driver, engine core, workers) through
the `vllm.general_plugins` entry point declared in pyproject.toml; a registration made only
in the driver is invisible to spawned engine processes. `VllmEngine` also calls it directly,
so the in-process engine works even without the package installed.

The models are registered by their `module:class` names, so this module does not import them
(nor vLLM's model code with them); vLLM imports one when it builds the model.
"""

from __future__ import annotations

from titanrl.rollout.vllm.names import ARCHITECTURE, MOE_ARCHITECTURE

MODEL_CLASSES = {
    ARCHITECTURE: "titanrl.rollout.vllm.model:TitanQwen3ForVLLM",
    MOE_ARCHITECTURE: "titanrl.rollout.vllm.model:TitanQwen3MoeForVLLM",
}
"""Our architecture names -> model classes, as `module:class` for `ModelRegistry.register_model`'s
lazy registration."""


def register() -> None:
    """Registers the architectures with vLLM; safe to call any number of times."""
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for name, cls in MODEL_CLASSES.items():
        if name not in supported:
            ModelRegistry.register_model(name, cls)
