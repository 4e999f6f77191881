"""The sizes the memory planner needs, read from an HF `config.json` through the family's spec.

The config is parsed by the family's own config class (`titanrl.models.architectures`), so the
planner reads every family TitanRL builds, refuses what the models refuse, and counts the biases
and q/k norms a family has; it never builds the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from titanrl.models.architectures import DEFAULT_ARCHITECTURE, spec_for_architecture


class PlanInputError(ValueError):
    """The planner cannot use its input (file, architecture, sizes); the message says what to change."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture sizes of a decoder of any registered family, named as in config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """SwiGLU width of the dense layers (every layer of a dense model, mlp_only_layers of an MoE)."""
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    architecture: str = DEFAULT_ARCHITECTURE
    qk_norm: bool = True
    """Per-head q/k RMSNorm in every layer (Qwen3)."""
    qkv_bias: bool = False
    """Biases on q/k/v (Qwen2, Llama with attention_bias)."""
    o_bias: bool = False
    """A bias on the attention output projection (Llama with attention_bias)."""
    mlp_bias: bool = False
    """Biases on the dense SwiGLU projections (Llama with mlp_bias)."""
    num_experts: int = 0
    """Routed experts per sparse layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is sent to (top-k)."""
    moe_intermediate_size: int = 0
    """SwiGLU width of one expert."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP in an MoE model."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        """HF Qwen3MoeDecoderLayer's rule for whether layer i has experts."""
        return (
            self.is_moe and i not in self.mlp_only_layers
            and self.decoder_sparse_step > 0 and (i + 1) % self.decoder_sparse_step == 0
        )

    # Parameter counts (elements). Each helper is one group that shards the same way.

    @property
    def attention_projection_params(self) -> int:
        """q, k, v, o projections of one layer (split by tp: whole heads per rank)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        biases = (q + 2 * kv) * self.qkv_bias + self.hidden_size * self.o_bias
        return 2 * self.hidden_size * q + 2 * self.hidden_size * kv + biases

    @property
    def layer_norm_params(self) -> int:
        """input/post-attention RMSNorm and the per-head q/k norms of one layer (replicated under tp)."""
        return 2 * self.hidden_size + 2 * self.head_dim * self.qk_norm

    @property
    def dense_mlp_params(self) -> int:
        """gate, up, down of a dense SwiGLU layer (split by tp)."""
        biases = (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        return 3 * self.hidden_size * self.intermediate_size + biases

    @property
    def router_params(self) -> int:
        """The gate Linear(hidden, num_experts) of a sparse layer (replicated)."""
        return self.hidden_size * self.num_experts

    @property
    def expert_params(self) -> int:
        """All experts of one sparse layer (split by ep, then FSDP-sharded over the rest)."""
        return 3 * self.hidden_size * self.moe_intermediate_size * self.num_experts

    def layer_params(self, i: int) -> int:
        mlp = self.router_params + self.expert_params if self.is_sparse_layer(i) else self.dense_mlp_params
        return self.attention_projection_params + self.layer_norm_params + mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        layers = sum(self.layer_params(i) for i in range(self.num_hidden_layers))
        return self.embedding_params + head + layers + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (top-k experts instead of all)."""
        unused = self.expert_params * (self.num_experts - self.num_experts_per_tok) // max(self.num_experts, 1)
        return self.total_params - unused * sum(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelShape:
        arch = (hf.get("architectures") or [DEFAULT_ARCHITECTURE])[0]
        try:
            spec = spec_for_architecture(arch)
        except ValueError as e:
            raise PlanInputError(f"{e}; point --model at a config.json of one of these") from None
        named = {**hf, **{ours: hf[alias] for alias, ours in spec.config_class.HF_ALIASES.items() if alias in hf}}
        # The planner wants the sizes stated: a default filled in for a missing size would plan another model.
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        required += ["num_experts", "num_experts_per_tok", "moe_intermediate_size"] if spec.is_moe else ["intermediate_size"]
        missing = [k for k in required if k not in named]
        if missing:
            raise PlanInputError(f"config.json ({arch}) lacks {', '.join(missing)}: add them to the file")
        try:
            config = spec.config_class.from_hf_dict(hf)
        except (TypeError, ValueError) as e:
            raise PlanInputError(f"config.json: {e}") from None
        shape = cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=int(hf.get("intermediate_size") or 0),
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            tie_word_embeddings=config.tie_word_embeddings,
            architecture=arch,
            qk_norm=config.QK_NORM,
            qkv_bias=config.has_qkv_bias,
            o_bias=config.has_o_bias,
            mlp_bias=config.has_mlp_bias,
        )
        if spec.is_moe:
            shape = replace(
                shape,
                num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                decoder_sparse_step=config.decoder_sparse_step,
                mlp_only_layers=tuple(config.mlp_only_layers),
            )
        shape.check()
        return shape

    @classmethod
    def from_config_json(cls, path: str | Path) -> ModelShape:
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise PlanInputError(f"--model {str(path)!r}: no such file; give the path of an HF config.json")
        try:
            hf = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise PlanInputError(f"--model {str(file)!r} is not valid JSON ({e}); give an HF config.json") from e
        if not isinstance(hf, dict):
            raise PlanInputError(f"--model {str(file)!r} holds a JSON {type(hf).__name__}, not a config object")
        return cls.from_hf_dict(hf)

    def check(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise PlanInputError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise PlanInputError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise PlanInputError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        dense_layers = [i for i in range(self.num_hidden_layers) if not self.is_sparse_layer(i)]
        if dense_layers and self.intermediate_size <= 0:
            raise PlanInputError(f"config.json: layers {dense_layers[:4]} are dense but intermediate_size is missing")

    def describe(self) -> str:
        """One line: architecture, parameter counts, the sizes that set memory."""
        kind = (
            f"MoE {self.num_experts} experts, top-{self.num_experts_per_tok}, expert width {self.moe_intermediate_size}"
            if self.is_moe else f"dense, MLP {self.intermediate_size}"
        )
        active = f" ({_billions(self.active_params)} active)" if self.is_moe else ""
        return (
            f"{self.architecture}: {_billions(self.total_params)} parameters{active}; {self.num_hidden_layers} layers, "
            f"hidden {self.hidden_size}, {self.num_attention_heads}/{self.num_key_value_heads} heads of {self.head_dim}, "
            f"{kind}, vocab {self.vocab_size}, {'tied' if self.tie_word_embeddings else 'untied'} head"
        )


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
