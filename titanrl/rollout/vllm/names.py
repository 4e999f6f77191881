"""Names shared by our vLLM model, its plugin and the engine (a leaf: imports nothing)."""

BATCH_INVARIANT_KEY = "titanrl_batch_invariant"
"""HF-config key (set through `hf_overrides`) that builds the model in batch-invariant mode;
it reaches spawned engine processes with the rest of the config."""
VLLM_KERNELS_KEY = "titanrl_vllm_kernels"
"""HF-config key (set through `hf_overrides`): False keeps our modules on torch's kernels inside
vLLM instead of vLLM's own (`titanrl.models.common.vllm_kernels`); absent means True."""
LORA_KEY = "titanrl_lora"
"""HF-config key (set through `hf_overrides`): {'rank', 'alpha', 'target_modules'} of a run with
lora.sync='adapter'; the model gets the trainer's adapters and takes pushes of them alone."""
