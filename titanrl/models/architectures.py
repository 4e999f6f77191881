"""The architectures TitanRL builds, keyed by config.json's `architectures[0]`: each one's config
and model class. The one place that decides dense or MoE from a checkpoint."""

from __future__ import annotations

from typing import Any

from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from titanrl.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, tuple[type[Qwen3Config], type[Qwen3ForCausalLM]]] = {
    Qwen3Config.HF_ARCHITECTURE: (Qwen3Config, Qwen3ForCausalLM),
    Qwen3MoeConfig.HF_ARCHITECTURE: (Qwen3MoeConfig, Qwen3MoeForCausalLM),
}


def config_from_hf_dict(hf: dict[str, Any]) -> Qwen3Config:
    """The config of the architecture config.json names (dense Qwen3 when it names none)."""
    arch = (hf.get("architectures") or [Qwen3Config.HF_ARCHITECTURE])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} in config.json: TitanRL builds "
                         f"{', '.join(repr(a) for a in ARCHITECTURES)}")
    return ARCHITECTURES[arch][0].from_hf_dict(hf)


def model_class(config: Qwen3Config) -> type[Qwen3ForCausalLM]:
    """The model class that builds `config`."""
    return ARCHITECTURES[config.HF_ARCHITECTURE][1]


def build_model(config: Qwen3Config, **kwargs: Any) -> Qwen3ForCausalLM:
    """A model of `config` (uninitialised weights), dense or MoE; kwargs go to the constructor."""
    return model_class(config)(config, **kwargs)
