"""Names shared by our vLLM model, its plugin and the engine (a leaf: imports nothing)."""

ARCHITECTURE = "TitanRLQwen3ForCausalLM"
"""The architecture name our dense model class is registered under."""
MOE_ARCHITECTURE = "TitanRLQwen3MoeForCausalLM"
"""The architecture name our mixture-of-experts model class is registered under."""
VLLM_ARCHITECTURES = {"Qwen3ForCausalLM": ARCHITECTURE, "Qwen3MoeForCausalLM": MOE_ARCHITECTURE}
"""config.json's architecture (`Qwen3Config.HF_ARCHITECTURE`) -> the name an engine asks vLLM for."""
BATCH_INVARIANT_KEY = "titanrl_batch_invariant"
"""HF-config key (set through `hf_overrides`) that builds the model in batch-invariant mode;
it reaches spawned engine processes with the rest of the config."""
VLLM_KERNELS_KEY = "titanrl_vllm_kernels"
"""HF-config key (set through `hf_overrides`): False keeps our modules on torch's kernels inside
vLLM instead of vLLM's own (`titanrl.rollout.vllm.kernel_overrides`); absent means True."""
