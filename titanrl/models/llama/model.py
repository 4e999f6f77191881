"""Llama: the shared decoder without q/k norms; optional attention and MLP biases; rotary
frequencies optionally scaled ('linear', or Llama 3.1's 'llama3')."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM


@dataclass
class LlamaConfig(DecoderConfig):
    """Llama's hyper-parameters, named as in config.json."""

    HF_ARCHITECTURE: ClassVar[str] = "LlamaForCausalLM"
    HF_MODEL_TYPE: ClassVar[str] = "llama"
    FAMILY: ClassVar[str] = "Llama"
    HF_DEFAULTS: ClassVar[dict[str, Any]] = dict(
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=2048,
        attention_bias=False, mlp_bias=False,
    )
    """transformers' LlamaConfig defaults (5.19) where they differ from ours."""
    UNSUPPORTED_HF_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "hidden_act": lambda v: v != "silu",
        "pretraining_tp": lambda v: v not in (None, 1),
    }

    attention_bias: bool = False
    """Biases on the q/k/v/o projections."""
    mlp_bias: bool = False
    """Biases on the gate/up/down projections."""

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def has_o_bias(self) -> bool:
        return self.attention_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.mlp_bias

    def hf_extras(self) -> dict[str, Any]:
        return {"pretraining_tp": 1}


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama decoder with an LM head; `forward` maps token ids [B, T] to logits [B, T, V]."""

    config: LlamaConfig
