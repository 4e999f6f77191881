"""The decoder every dense family shares, in plain PyTorch: Llama, Qwen2 and Qwen3 differ only in
switches of one config (q/k norms, which projections carry a bias, how rotary frequencies scale).

This single definition serves the trainer and vLLM (through `titanrl.rollout.vllm.model`, which
swaps in vLLM's paged-KV attention as the attention backend). Module and parameter names are
exactly Hugging Face's, so an HF state dict loads with no renaming. A family folder
(`titanrl/models/<family>/`) subclasses `DecoderConfig` (its config.json fields and defaults) and
`DecoderForCausalLM`, and registers a `ModelSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from titanrl import kernels
from titanrl.models.common.grad_in_place import embed
from titanrl.models.common.lora import LoraLinear, recompute_merged_weights
from titanrl.models.common.rope import read_rope_scaling, rope_inv_freq
from titanrl.models.packed_sequences import PackedSequences, packed_attention, varlen_flash_attention


@dataclass
class DecoderConfig:
    """Architecture hyper-parameters, named as in an HF `config.json`. Family subclasses set the
    class-level switches and `HF_DEFAULTS`; the field defaults are sized for tests."""

    HF_ARCHITECTURE: ClassVar[str] = ""
    """The `architectures[0]` of config.json this config reads and writes."""
    HF_MODEL_TYPE: ClassVar[str] = ""
    """config.json's `model_type`."""
    FAMILY: ClassVar[str] = ""
    """A human name for errors ("Qwen3", "Llama")."""
    QK_NORM: ClassVar[bool] = False
    """Per-head RMSNorm of queries and keys before rotary (Qwen3)."""
    HF_ALIASES: ClassVar[dict[str, str]] = {}
    """config.json spellings of our fields (transformers 5 writes some under other names)."""
    HF_DEFAULTS: ClassVar[dict[str, Any]] = {}
    """transformers' defaults for fields a config.json may leave out, where they differ from ours."""
    UNSUPPORTED_HF_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = {}
    """config.json fields whose value (when the test is true) this model cannot compute: refused by
    name rather than ignored (silently ignoring it would compute another model)."""

    vocab_size: int = 512
    """Number of token ids the embedding and LM head cover."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 384
    """Width of the SwiGLU MLP's hidden layer."""
    num_hidden_layers: int = 2
    """Number of decoder blocks."""
    num_attention_heads: int = 4
    """Query heads per attention layer."""
    num_key_value_heads: int = 2
    """Key/value heads; fewer than query heads means grouped-query attention."""
    head_dim: int = 32
    """Per-head width; vLLM's CPU attention supports 32 and 64 (not 16)."""
    rms_norm_eps: float = 1e-6
    """Epsilon inside every RMSNorm, including the per-head q/k norms."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary-embedding frequencies."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary frequency scaling (`rope_type` 'linear' or 'llama3' with its factors); None is unscaled."""
    max_position_embeddings: int = 2048
    """Longest sequence (prompt + completion) the model is configured for."""
    tie_word_embeddings: bool = True
    """Share one matrix between the input embedding and the LM head."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id recorded in config.json (not prepended by the model)."""
    eos_token_id: int | None = None
    """End-of-sequence id recorded in config.json; generation stops on it."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{type(self).__name__}.{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"{type(self).__name__}.head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def has_qkv_bias(self) -> bool:
        """Whether q/k/v carry biases (families override)."""
        return False

    @property
    def has_o_bias(self) -> bool:
        """Whether the attention output projection carries a bias (families override)."""
        return False

    @property
    def has_mlp_bias(self) -> bool:
        """Whether gate/up/down carry biases (families override)."""
        return False

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Reads the fields we use from an HF `config.json` dict (transformers' defaults for the
        ones it leaves out); refuses fields this model cannot honour; ignores the rest."""
        archs = hf.get("architectures") or [cls.HF_ARCHITECTURE]
        if archs[0] != cls.HF_ARCHITECTURE:
            raise ValueError(
                f"unsupported architecture {archs[0]!r} in config.json: {cls.__name__} "
                f"reads {cls.HF_ARCHITECTURE!r} checkpoints"
            )
        hf = {**cls.HF_DEFAULTS, **hf}
        for name, unsupported in cls.UNSUPPORTED_HF_FIELDS.items():
            if name in hf and unsupported(hf[name]):
                raise ValueError(f"config.json sets {name}={hf[name]!r}, which TitanRL's {cls.FAMILY} "
                                 f"models do not support")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in known}
        kwargs["rope_theta"], kwargs["rope_scaling"] = read_rope_scaling(hf, cls.HF_DEFAULTS.get("rope_theta"))
        if kwargs["rope_theta"] is None:
            kwargs.pop("rope_theta")
        if kwargs.get("head_dim") is None and "hidden_size" in hf:
            kwargs["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)

    def hf_extras(self) -> dict[str, Any]:
        """Family-specific config.json entries `to_hf_dict` adds (model type and fixed switches)."""
        return {}

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' class of this family loads."""
        d = asdict(self)
        scaling = d.pop("rope_scaling")
        d.update(
            architectures=[self.HF_ARCHITECTURE],
            model_type=self.HF_MODEL_TYPE,
            hidden_act="silu",
            attention_dropout=0.0,
            rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta},
            torch_dtype="float32",
        )
        d.update(self.hf_extras())
        return d


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as every Llama-style family does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return kernels.rms_norm(x, self.weight, self.variance_epsilon)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions (vLLM's positions are not always 0..T-1).

    Frequencies are recomputed per call in float32 rather than kept in a buffer, so
    meta-device construction and dtype casts of the model can never corrupt them.
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int = 0,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.scaling = scaling
        self.batch_invariant = False

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, positions.device)
        freqs = positions[..., None].float() * inv_freq
        return torch.cat((freqs, freqs), dim=-1)

    def forward(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_invariant:
            # cos/sin take a vectorised or a scalar path depending on where an element falls in
            # the tensor, so compute them once over a fixed-shape table and gather rows.
            span = max(self.max_positions, int(positions_BT.max()) + 1 if positions_BT.numel() else 1)
            table = self._angles(torch.arange(span, device=positions_BT.device))
            return table.cos().to(dtype)[positions_BT], table.sin().to(dtype)[positions_BT]
        emb_BTD = self._angles(positions_BT)
        return emb_BTD.cos().to(dtype), emb_BTD.sin().to(dtype)


def _call(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection through the batch-invariant matmul (every matmul of an adapted one too)."""
    if isinstance(layer, LoraLinear):
        return layer(x, kernels.linear)
    return kernels.linear(x, layer.weight, layer.bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BTHD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, :, None, :], sin_BTD[:, :, None, :]
    return x_BTHD * cos + _rotate_half(x_BTHD) * sin


class CausalSDPA(nn.Module):
    """Default attention backend: causal softmax attention over one padded batch, or over the
    sequences of one packed row while `packed` is set (the trainer's packed micro-batches).

    Right padding is safe: a real token never attends to the pad tokens after it.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_groups = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.batch_invariant = False
        self.packed: PackedSequences | None = None
        """Set (by `packed_attention_layout`): q/k/v are [1, N, ., D] holding these sequences end to end."""

    def forward(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return self._padded(q_BTHD, k_BTKD, v_BTKD)
        if not self.batch_invariant:
            out = varlen_flash_attention(q_BTHD, k_BTKD, v_BTKD, self.packed, self.scale)
            if out is not None:
                return out
        return packed_attention(self._padded, q_BTHD, k_BTKD, v_BTKD, self.packed)

    def _padded(self, q_BTHD: torch.Tensor, k_BTKD: torch.Tensor, v_BTKD: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return kernels.attention(q_BTHD, k_BTKD, v_BTKD, scale=self.scale)
        q, k, v = (t.transpose(1, 2) for t in (q_BTHD, k_BTKD, v_BTKD))
        if self.num_groups > 1:
            k = k.repeat_interleave(self.num_groups, dim=1)
            v = v.repeat_interleave(self.num_groups, dim=1)
        out_BHTD = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out_BHTD.transpose(1, 2)


LMHead = Callable[[torch.Tensor, torch.Tensor], Any]
"""A replacement for the LM head's matmul: head(final-norm hidden [B, T, D], lm_head.weight [V, D])."""

AttentionBackendFactory = Callable[[int], nn.Module]
"""Builds the attention backend for decoder layer `i`; called as backend(q, k, v)."""

FeedForwardFactory = Callable[[int], nn.Module]
"""Builds decoder layer `i`'s feed-forward block (`mlp`): dense SwiGLU or a mixture of experts."""


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings; per-head q/k RMSNorm where the family has
    it (`q_norm`/`k_norm` exist only then, so parameter names stay the family's)."""

    def __init__(self, config: DecoderConfig, backend: nn.Module) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.has_qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.has_qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.has_qkv_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.has_o_bias)
        if c.QK_NORM:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.backend = backend
        self.batch_invariant = False

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        proj = _linear if self.batch_invariant else _call
        # Head counts come from the projections' widths (-1), not the config: under tensor
        # parallelism each rank holds num_heads / tp of them.
        q_norm, k_norm = self.qk_norms()
        q = q_norm(proj(self.q_proj, x_BTD).view(B, T, -1, self.head_dim))
        k = k_norm(proj(self.k_proj, x_BTD).view(B, T, -1, self.head_dim))
        v = proj(self.v_proj, x_BTD).view(B, T, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out_BTHD = self.backend(q, k, v)
        return proj(self.o_proj, out_BTHD.reshape(B, T, -1))

    def qk_norms(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """The per-head q and k norms, identities for a family without them."""
        q_norm = getattr(self, "q_norm", None)
        return (_identity, _identity) if q_norm is None else (q_norm, self.k_norm)


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        bias = config.has_mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            hidden = kernels.silu_gate(_linear(self.gate_proj, x), _linear(self.up_proj, x))
            return _linear(self.down_proj, hidden)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    With `checkpoint_activations` set (the trainer's activation checkpointing) and grad enabled,
    the block keeps only its inputs for backward and recomputes the rest there. The flag lives
    on the layer rather than in a wrapper module, so parameter names stay Hugging Face's; it is
    off by default and inert without grad (vLLM and every no-grad forward).
    """

    def __init__(self, config: DecoderConfig, attention_backend: nn.Module, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, attention_backend)
        self.mlp = MLP(config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.checkpoint_activations = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_activations and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._block, x, cos, sin, use_reentrant=False)
        with recompute_merged_weights(self):  # LoRA: the backward re-merges instead of keeping merged weights
            return self._block(x, cos, sin)

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBackbone(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: DecoderConfig, attention_backend: AttentionBackendFactory,
                 feed_forward: FeedForwardFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention_backend(i), None if feed_forward is None else feed_forward(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                          config.rope_scaling)


class DecoderForCausalLM(nn.Module):
    """A decoder with an LM head; `forward` maps token ids [B, T] to logits [B, T, V]."""

    def __init__(self, config: DecoderConfig, attention_backend: AttentionBackendFactory | None = None) -> None:
        super().__init__()
        self.config = config
        if attention_backend is None:

            def attention_backend(layer_idx: int) -> nn.Module:
                return CausalSDPA(config.num_attention_heads, config.num_key_value_heads, config.head_dim)

        self.model = DecoderBackbone(config, attention_backend, self.feed_forward_factory(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.batch_invariant = False

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder blocks, in order (what parallelism wraps, checkpoints and compiles)."""
        return list(self.model.layers)

    def input_embedding(self) -> nn.Embedding:
        """The token embedding."""
        return self.model.embed_tokens

    def output_head(self) -> nn.Linear:
        """The LM head (with tied embeddings its weight is the embedding's)."""
        return self.lm_head

    @staticmethod
    def feed_forward_factory(config: DecoderConfig) -> FeedForwardFactory | None:
        """Each layer's `mlp`; None is the dense SwiGLU everywhere (the MoE model overrides this)."""
        return None

    def set_batch_invariant(self, enabled: bool = True) -> DecoderForCausalLM:
        """Routes every op through `titanrl.kernels` (True) or the fast library kernels (False).

        In batch-invariant mode a token's logits have the same bits whatever else is in the
        batch, however the sequence was padded or chunked, and in a training forward, a
        prefill or a decode step. Parameters are untouched; only the arithmetic changes.
        """
        for module in self.modules():
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = enabled
        return self

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Fresh normal(0, std) weights and unit norms; deterministic for a given seed."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def hidden_states(self, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, hidden]."""
        if positions_BT is None:
            positions_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
        h = embed(self.model.embed_tokens, input_ids_BT)
        cos, sin = self.model.rotary_emb(positions_BT, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(self.lm_head, hidden) if self.batch_invariant else self.lm_head(hidden)

    def forward(self, input_ids_BT: torch.Tensor, positions_BT: torch.Tensor | None = None,
                head: LMHead | None = None) -> Any:
        """Logits [B, T, V]; with `head`, `head(final-norm hidden [B, T, D], lm_head.weight)` instead.

        `head` lets the trainer run its own LM head (chunked logprobs, no full logits) inside
        `forward`, where FSDP holds the head's weight unsharded.
        """
        hidden = self.hidden_states(input_ids_BT, positions_BT)
        return self.compute_logits(hidden) if head is None else head(hidden, self.lm_head.weight)
