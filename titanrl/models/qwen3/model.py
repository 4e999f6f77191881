"""Qwen3 (dense): the shared decoder with per-head q/k RMSNorm and no biases by default."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM

HF_ARCHITECTURE = "Qwen3ForCausalLM"


@dataclass
class Qwen3Config(DecoderConfig):
    """Qwen3's hyper-parameters, named as in config.json."""

    HF_ARCHITECTURE: ClassVar[str] = HF_ARCHITECTURE
    HF_MODEL_TYPE: ClassVar[str] = "qwen3"
    FAMILY: ClassVar[str] = "Qwen3"
    QK_NORM: ClassVar[bool] = True
    UNSUPPORTED_HF_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "hidden_act": lambda v: v != "silu",
        "attention_bias": bool,
        "use_sliding_window": bool,
        "layer_types": lambda v: any(t != "full_attention" for t in v or ()),
    }

    def hf_extras(self) -> dict[str, Any]:
        return {"attention_bias": False, "use_sliding_window": False}


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 decoder with an LM head; `forward` maps token ids [B, T] to logits [B, T, V]."""

    config: Qwen3Config
