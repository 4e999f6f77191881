"""Qwen2 / Qwen2.5: the shared decoder with biases on q/k/v (not on o), no q/k norms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM


@dataclass
class Qwen2Config(DecoderConfig):
    """Qwen2's hyper-parameters, named as in config.json."""

    HF_ARCHITECTURE: ClassVar[str] = "Qwen2ForCausalLM"
    HF_MODEL_TYPE: ClassVar[str] = "qwen2"
    FAMILY: ClassVar[str] = "Qwen2"
    HF_DEFAULTS: ClassVar[dict[str, Any]] = dict(
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
    )
    """transformers' Qwen2Config defaults (5.19) where they differ from ours."""
    UNSUPPORTED_HF_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "hidden_act": lambda v: v != "silu",
        # Qwen2.5 configs carry sliding_window/max_window_layers but switch it off; on is refused.
        "use_sliding_window": bool,
        "layer_types": lambda v: any(t != "full_attention" for t in v or ()),
    }

    @property
    def has_qkv_bias(self) -> bool:
        return True

    def hf_extras(self) -> dict[str, Any]:
        return {"use_sliding_window": False}


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 decoder with an LM head; `forward` maps token ids [B, T] to logits [B, T, V]."""

    config: Qwen2Config
