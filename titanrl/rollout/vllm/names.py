"""Names shared by our vLLM model, its plugin and the engine (a leaf: imports nothing)."""

ARCHITECTURE = "TitanRLQwen3ForCausalLM"
"""The architecture name our model class is registered under."""
BATCH_INVARIANT_KEY = "titanrl_batch_invariant"
"""HF-config key (set through `hf_overrides`) that builds the model in batch-invariant mode;
it reaches spawned engine processes with the rest of the config."""
