"""Llama (2, 3, 3.1, 3.2 and models of its shape such as SmolLM2): config, model and spec."""

from titanrl.models.llama.model import LlamaConfig, LlamaForCausalLM
from titanrl.models.spec import ModelSpec

SPEC = ModelSpec(name="llama", config_class=LlamaConfig, model_class=LlamaForCausalLM)

__all__ = ["SPEC", "LlamaConfig", "LlamaForCausalLM"]
