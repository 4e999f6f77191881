"""The model registry: config.json's `architectures[0]` -> the family's `ModelSpec`.

Adding a family is its folder under `titanrl/models/` plus one line in `SPECS`. This is also the
one place that decides dense or MoE from a checkpoint.
"""

from __future__ import annotations

from typing import Any

from titanrl.models import llama, qwen2, qwen3
from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM
from titanrl.models.spec import ModelSpec

SPECS: dict[str, ModelSpec] = {
    spec.architecture: spec
    for spec in (
        qwen3.SPEC,
        qwen3.MOE_SPEC,
        llama.SPEC,
        qwen2.SPEC,
    )
}
"""Every family TitanRL builds, keyed by its HF architecture name."""

DEFAULT_ARCHITECTURE = qwen3.SPEC.architecture
"""What a config.json without `architectures` is read as (our own tiny checkpoints of old)."""


def spec_for_architecture(arch: str) -> ModelSpec:
    """The spec of HF architecture `arch`; a ValueError naming the supported ones otherwise."""
    if arch not in SPECS:
        raise ValueError(f"unsupported architecture {arch!r} in config.json: TitanRL builds "
                         f"{', '.join(repr(a) for a in SPECS)}")
    return SPECS[arch]


def spec_for(config: DecoderConfig) -> ModelSpec:
    """The spec of the family `config` belongs to."""
    return spec_for_architecture(config.HF_ARCHITECTURE)


def config_from_hf_dict(hf: dict[str, Any]) -> DecoderConfig:
    """The config of the architecture config.json names (dense Qwen3 when it names none)."""
    arch = (hf.get("architectures") or [DEFAULT_ARCHITECTURE])[0]
    return spec_for_architecture(arch).config_class.from_hf_dict(hf)


def model_class(config: DecoderConfig) -> type[DecoderForCausalLM]:
    """The model class that builds `config`."""
    return spec_for(config).model_class


def build_model(config: DecoderConfig, **kwargs: Any) -> DecoderForCausalLM:
    """A model of `config` (uninitialised weights), dense or MoE; kwargs go to the constructor."""
    return model_class(config)(config, **kwargs)
