"""vLLM plugin: registers our model families in vLLM's ModelRegistry under our own names.

vLLM calls `register()` in every process it starts (driver, engine core, workers) through
the `vllm.general_plugins` entry point declared in pyproject.toml; a registration made only
in the driver is invisible to spawned engine processes. `VllmEngine` also calls it directly,
so the in-process engine works even without the package installed.

Every family in `titanrl.models.architectures.SPECS` is registered by its `module:class` name
(`ModelSpec.vllm_architecture`, a class `titanrl.rollout.vllm.model` builds on first access), so
this module does not import vLLM's model code; vLLM imports a class when it builds the model.
"""

from __future__ import annotations

MODEL_MODULE = "titanrl.rollout.vllm.model"
"""Where the vLLM classes of our families live (built lazily from their specs)."""


def model_classes() -> dict[str, str]:
    """Our vLLM architecture names -> `module:class` for `ModelRegistry.register_model`."""
    from titanrl.models.architectures import SPECS

    return {spec.vllm_architecture: f"{MODEL_MODULE}:{spec.vllm_architecture}" for spec in SPECS.values()}


def register() -> None:
    """Registers the architectures with vLLM; safe to call any number of times."""
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for name, cls in model_classes().items():
        if name not in supported:
            ModelRegistry.register_model(name, cls)
