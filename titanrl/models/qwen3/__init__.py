"""Qwen3 dense and Qwen3-MoE: configs, models and their specs."""

from titanrl.models.common.decoder import (  # noqa: F401  (the modules Qwen3 is built of)
    MLP,
    Attention,
    CausalSDPA,
    DecoderLayer,
    FeedForwardFactory,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from titanrl.models.qwen3.model import HF_ARCHITECTURE, Qwen3Config, Qwen3ForCausalLM
from titanrl.models.spec import ModelSpec

SPEC = ModelSpec(name="qwen3", config_class=Qwen3Config, model_class=Qwen3ForCausalLM)
"""Dense Qwen3 (Qwen3-0.6B ... 32B)."""

__all__ = ["HF_ARCHITECTURE", "SPEC", "Qwen3Config", "Qwen3ForCausalLM"]

from titanrl.models.qwen3.moe import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from titanrl.models.qwen3.parallelize import MOE_PLAN  # noqa: E402

MOE_SPEC = ModelSpec(name="qwen3_moe", config_class=Qwen3MoeConfig, model_class=Qwen3MoeForCausalLM, is_moe=True,
                     parallel_plan=MOE_PLAN, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
"""Qwen3-MoE (Qwen3-30B-A3B and smaller test shapes): sparse mixture-of-experts feed-forward blocks."""

__all__ += ["MOE_SPEC", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"]
