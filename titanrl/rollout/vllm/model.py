"""Our Qwen3 modules inside vLLM: the class vLLM's model registry builds.

vLLM flattens a scheduled batch into one sequence of `num_tokens` tokens with explicit
positions; its `Attention` layer finds each token's request, writes K/V into the paged
cache and attends over that request's cached keys. `TitanQwen3ForVLLM` *is* our
`Qwen3ForCausalLM` (same modules, same HF parameter names) built with one attention
backend per layer that hands q/k/v to vLLM's `Attention`; the whole flattened batch runs
as a batch of one, `[1, num_tokens]`.

Registered under `ARCHITECTURE` (`names.py`) by `plugin.py`; an engine opts in with
`hf_overrides={"architectures": [ARCHITECTURE]}`, so vLLM's built-in Qwen3 stays as is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from titanrl.models.qwen3 import HF_ARCHITECTURE, Qwen3Config, Qwen3ForCausalLM
from titanrl.rollout.vllm.names import ARCHITECTURE, BATCH_INVARIANT_KEY
from titanrl.rollout.vllm.paged_attention import paged_batch_invariant_attention



def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class VllmPagedAttention(nn.Module):
    """Attention backend for our model that runs vLLM's paged-KV `Attention` layer, or, in
    batch-invariant mode, our own attention over the same cache (`paged_attention`).

    Called as `backend(q_BTHD, k_BTKD, v_BTKD)` with rope and q/k norms applied and KV
    heads not repeated; B must be 1 (vLLM's flattened batch). vLLM takes `[N, heads*D]`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attn = Attention(
            num_heads,
            head_dim,
            head_dim**-0.5,
            num_kv_heads=num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        )
        self.batch_invariant = False
        """In batch-invariant mode the layer's cache is ours to lay out (see paged_attention)."""

    def forward(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor) -> torch.Tensor:
        B, T, H, D = q_BTHD.shape
        if B != 1:
            raise ValueError(f"vLLM runs a flattened batch: expected B == 1, got q of shape {tuple(q_BTHD.shape)}")
        if self.batch_invariant:
            return paged_batch_invariant_attention(self.attn, q_BTHD[0], k_BTKD[0], v_BTKD[0])[None]
        kv = self.num_kv_heads * D
        out_NHD = self.attn(q_BTHD.reshape(T, H * D), k_BTKD.reshape(T, kv), v_BTKD.reshape(T, kv))
        return out_NHD.view(B, T, H, D)


def config_from_vllm(vllm_config: VllmConfig) -> Qwen3Config:
    """Our Qwen3Config from the HF config vLLM loaded (architectures overridden to ours)."""
    hf = vllm_config.model_config.hf_config.to_dict()
    hf["architectures"] = [HF_ARCHITECTURE]
    return Qwen3Config.from_hf_dict(hf)


class TitanQwen3ForVLLM(Qwen3ForCausalLM):
    """vLLM's model interface around our Qwen3ForCausalLM.

    Differences from the parent, all at the boundary: `forward` takes vLLM's flattened
    `input_ids [N]` / `positions [N]` and returns final-norm hidden states `[N, hidden]`
    (vLLM computes logits only for the rows it samples from, via `compute_logits`).
    Parameters keep HF names, so vLLM's loader, `load_weights` and in-place pushes all use
    checkpoint names directly; with tied embeddings `lm_head.weight` *is* the embedding
    Parameter, so a push to `model.embed_tokens.weight` moves the LM head too.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = config_from_vllm(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"{ARCHITECTURE} runs unsharded inside vLLM: set tensor_parallel_size=1 and "
                "pipeline_parallel_size=1 (scale rollouts with more engines instead)"
            )

        def attention_backend(layer_idx: int) -> nn.Module:
            # The prefix is the module path, unique per layer, as vLLM's KV-cache binding needs.
            return VllmPagedAttention(
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                vllm_config,
                prefix=_join(prefix, f"model.layers.{layer_idx}.self_attn.backend.attn"),
            )

        super().__init__(config, attention_backend=attention_backend)
        self.vllm_config = vllm_config
        hf = vllm_config.model_config.hf_config
        self.set_batch_invariant(bool(getattr(hf, BATCH_INVARIANT_KEY, False)))

    # --- vLLM model interface -------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: object | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise NotImplementedError(f"{ARCHITECTURE} does not support pipeline parallelism in vLLM")
        if inputs_embeds is not None:
            raise NotImplementedError(f"{ARCHITECTURE} does not accept prompt embeddings (inputs_embeds)")
        assert input_ids is not None
        return self.hidden_states(input_ids[None, :], positions[None, :])[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the parameters in place; returns the names loaded.

        Used by vLLM's loader at start-up and by the TitanRL worker extension for pushes.
        A tied `lm_head.weight` is skipped (it is the embedding). Unknown names and shape
        mismatches raise rather than being ignored.
        """
        params = dict(self.named_parameters())  # de-duplicated: a tied head appears once
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # some HF checkpoints carry this buffer; we recompute it
                param = params.get(name)
                if param is None:
                    raise KeyError(f"{ARCHITECTURE}: weight {name!r} matches no parameter of the model")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{ARCHITECTURE}: weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(name)
        return loaded
