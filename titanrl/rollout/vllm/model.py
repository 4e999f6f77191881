"""Our model families inside vLLM: the classes vLLM's model registry builds.

vLLM flattens a scheduled batch into one sequence of `num_tokens` tokens with explicit
positions; its `Attention` layer finds each token's request, writes K/V into the paged
cache and attends over that request's cached keys. The vLLM class of a family *is* the family's
model class (same modules, same parameter names) with one mixin, `VllmModelBoundary`, in front:
it builds one attention backend per layer that hands q/k/v to vLLM's `Attention`, and the whole
flattened batch runs as a batch of one, `[1, num_tokens]`. A mixture-of-experts model's router
and experts stay our modules (not vLLM's FusedMoE), so the generator routes and computes exactly
as the trainer does.

`vllm_model_class(spec)` makes a family's class; this module's `__getattr__` serves it under
`spec.vllm_architecture` (`TitanRLQwen3ForCausalLM`, `TitanRLLlamaForCausalLM`, ...), the name
`plugin.py` registers. An engine opts in with `hf_overrides={"architectures": [...]}`, so vLLM's
built-in models stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from titanrl.models.architectures import SPECS, spec_for
from titanrl.config.schema import LoraConfig
from titanrl.config.validation import lora_targets
from titanrl.models.common.decoder import DecoderConfig
from titanrl.models.common.lora import adapter_parameters, add_adapters
from titanrl.models.qwen3.moe import parse_expert_checkpoint_name, routing_buffers
from titanrl.models.spec import ModelSpec
from titanrl.models.common.vllm_kernels import apply_vllm_kernels, repack_vllm_kernels
from titanrl.rollout.vllm.names import BATCH_INVARIANT_KEY, LORA_KEY, VLLM_KERNELS_KEY
from titanrl.rollout.vllm.paged_attention import paged_batch_invariant_attention
from titanrl.rollout.vllm.routing_record import RoutingRecorder


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


def config_from_vllm(vllm_config: VllmConfig, config_class: type[DecoderConfig]) -> DecoderConfig:
    """Our config from the HF config vLLM loaded (its architectures overridden to ours)."""
    hf_config = vllm_config.model_config.hf_config
    hf = hf_config.to_dict()
    # transformers renames some config.json keys in memory (Qwen3-MoE's num_experts is
    # num_local_experts); its attribute_map gives the config.json name back.
    for json_name, attr_name in getattr(hf_config, "attribute_map", {}).items():
        if attr_name in hf and json_name not in hf:
            hf[json_name] = hf[attr_name]
    hf["architectures"] = [config_class.HF_ARCHITECTURE]
    return config_class.from_hf_dict(hf)


class VllmModelBoundary:
    """vLLM's model interface around one of our causal LMs; mixed in before the model class.

    Differences from the model, all at the boundary: `forward` takes vLLM's flattened
    `input_ids [N]` / `positions [N]` and returns final-norm hidden states `[N, hidden]`
    (vLLM computes logits only for the rows it samples from, via `compute_logits`).
    Parameters keep the model's names, so `load_weights` and in-place pushes use them directly;
    with tied embeddings the head's weight *is* the embedding Parameter, so a push to the
    embedding moves the LM head too.
    """

    vllm_architecture: ClassVar[str]
    """The name this class is registered under in vLLM."""
    titan_config_class: ClassVar[type[DecoderConfig]]
    """The config our model is built from."""
    routing_recorder: RoutingRecorder | None = None
    """Set on a mixture-of-experts model (the worker extension's `titanrl_record_routing`): every
    forward then records each request's routing."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = config_from_vllm(vllm_config, self.titan_config_class)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(
                f"{self.vllm_architecture} runs unsharded inside vLLM: set tensor_parallel_size=1 and "
                "pipeline_parallel_size=1 (scale rollouts with more engines instead)"
            )

        spec = spec_for(config)
        layers_prefix, core = spec.state_dict_adapter.layers_prefix, spec.parallel_plan.attention_core

        def attention_backend(layer_idx: int) -> nn.Module:
            # The prefix is the module path, unique per layer, as vLLM's KV-cache binding needs.
            return VllmPagedAttention(
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                vllm_config,
                prefix=_join(prefix, f"{layers_prefix}{layer_idx}.{core}.attn"),
            )

        super().__init__(config, attention_backend=attention_backend)  # type: ignore[call-arg]
        self.vllm_config = vllm_config
        hf = vllm_config.model_config.hf_config
        lora = getattr(hf, LORA_KEY, None)
        if lora:
            # The trainer's adapters, at zero until the first push (B = 0: the base model), in the
            # trainer's unmerged form: a push lands in A and B and needs no merge.
            targets = lora_targets(LoraConfig(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                                              target_modules=lora.get("target_modules")), config)
            add_adapters(self, targets, int(lora["rank"]), float(lora["alpha"]), unmerged=True)  # type: ignore[arg-type]
        batch_invariant = bool(getattr(hf, BATCH_INVARIANT_KEY, False))
        self.set_batch_invariant(batch_invariant)  # type: ignore[attr-defined]
        if not batch_invariant and bool(getattr(hf, VLLM_KERNELS_KEY, True)) and _is_cpu():
            apply_vllm_kernels(self)  # type: ignore[arg-type]

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level post-load hook; the worker extension calls it after every push too:
        rebuilds the packed weight copies of the vLLM-kernel overrides (none without them)."""
        repack_vllm_kernels(self)  # type: ignore[arg-type]

    # --- vLLM model interface -------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.input_embedding()(input_ids)  # type: ignore[attr-defined]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: object | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise NotImplementedError(f"{self.vllm_architecture} does not support pipeline parallelism in vLLM")
        if inputs_embeds is not None:
            raise NotImplementedError(f"{self.vllm_architecture} does not accept prompt embeddings (inputs_embeds)")
        assert input_ids is not None
        recorder = self.routing_recorder
        query_start_loc = _query_start_loc() if recorder is not None else None
        if recorder is None or query_start_loc is None:  # not recording, or vLLM's warm-up (no metadata)
            return self.hidden_states(input_ids[None, :], positions[None, :])[0]  # type: ignore[attr-defined]
        recorder.begin(int(query_start_loc[-1]))
        hidden = self.hidden_states(input_ids[None, :], positions[None, :])[0]  # type: ignore[attr-defined]
        recorder.end(positions, query_start_loc)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies named tensors into the parameters in place; returns the parameter names loaded.

        Used by vLLM's loader at start-up (checkpoint names: one tensor per expert goes into its
        row of the stacked parameter, `parse_expert_checkpoint_name`) and by the TitanRL worker
        extension for pushes (the model's own names, stacked experts whole). A tied head is
        skipped (it is the embedding). Unknown names and shape
        mismatches raise rather than being ignored.
        """
        params = dict(self.named_parameters())  # type: ignore[attr-defined]  # a tied head appears once
        params.update(routing_buffers(self))  # the router biases a 'bias' load-balancing push carries
        tied = self.config.tie_word_embeddings  # type: ignore[attr-defined]
        adapter = spec_for(self.config).state_dict_adapter  # type: ignore[attr-defined]
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name == adapter.head and tied:
                    continue
                if adapter.is_recomputed(name):
                    continue  # some HF checkpoints carry such buffers; the model recomputes them
                expert = parse_expert_checkpoint_name(name)
                param_name = name if expert is None else expert[0]
                param = params.get(param_name)
                if param is None:
                    raise KeyError(f"{self.vllm_architecture}: weight {name!r} matches no parameter of the model")
                if expert is not None and expert[1] >= param.shape[0]:
                    raise KeyError(f"{self.vllm_architecture}: weight {name!r} names expert {expert[1]}, "
                                   f"the model has {param.shape[0]}")
                dest = param if expert is None else param[expert[1]]
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"{self.vllm_architecture}: weight {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(param_name)
        factors = adapter_parameters(self)  # type: ignore[arg-type]
        if factors and not loaded & set(factors):  # the base checkpoint at start-up: adapters stay at zero
            loaded |= set(factors)
        return loaded


_CLASSES: dict[str, type] = {}


def vllm_model_class(spec: ModelSpec) -> type:
    """The vLLM model class of a family: `VllmModelBoundary` in front of its model class (one
    class per family, made once)."""
    cls = _CLASSES.get(spec.vllm_architecture)
    if cls is None:
        cls = _CLASSES[spec.vllm_architecture] = type(spec.vllm_architecture, (VllmModelBoundary, spec.model_class), {
            "__doc__": f"Our {spec.config_class.FAMILY} as a vLLM model.",
            "__module__": __name__,
            "vllm_architecture": spec.vllm_architecture,
            "titan_config_class": spec.config_class,
        })
    return cls


def __getattr__(name: str) -> type:
    """Serves `TitanRL<Architecture>` for vLLM's lazy `module:class` registration."""
    for spec in SPECS.values():
        if spec.vllm_architecture == name:
            return vllm_model_class(spec)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _query_start_loc() -> torch.Tensor | None:
    """This step's request boundaries in the flattened batch (int32 [R + 1]); None when vLLM
    runs the model without attention metadata (warm-up, profiling)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    return None if metadata is None else metadata.query_start_loc
