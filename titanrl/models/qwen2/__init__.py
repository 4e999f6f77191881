"""Qwen2 and Qwen2.5 (Instruct, Math, Coder): config, model and spec."""

from titanrl.models.qwen2.model import Qwen2Config, Qwen2ForCausalLM
from titanrl.models.spec import ModelSpec

SPEC = ModelSpec(name="qwen2", config_class=Qwen2Config, model_class=Qwen2ForCausalLM)

__all__ = ["SPEC", "Qwen2Config", "Qwen2ForCausalLM"]
