"""Qwen3-MoE: the dense Qwen3 decoder with sparse mixture-of-experts feed-forward blocks.

Attention, norms, rotary embeddings and the LM head are the dense model's (`model.py`); only a
layer's `mlp` differs. A sparse block routes each token to `num_experts_per_tok` of
`num_experts` SwiGLU experts:

- the router (`mlp.gate`) scores experts in float32, takes the top-k of the softmax and, with
  `norm_topk_prob`, renormalises those k weights to sum to one;
- the experts' weights are stacked, `[num_experts, out, in]`, so one grouped matmul
  (`torch._grouped_mm`) runs every expert over its contiguous slice of the expert-sorted tokens
  (a per-expert loop where grouped matmul is unavailable, and in batch-invariant mode);
- the combine is a gather and a fixed-order sum over the k slots: no scatter-add, so the result
  does not depend on thread timing.

Parameter names follow transformers' in-memory Qwen3-MoE where they can (`mlp.gate.weight`),
with the stacked experts as `mlp.experts.{gate,up,down}_proj` `[E, out, in]`. Checkpoints on
disk keep one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, what the Hub's files,
transformers' loader and vLLM's built-in Qwen3-MoE read); `expert_checkpoint_name` and
`parse_expert_checkpoint_name` are the one mapping between the two.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanrl import kernels
from titanrl.models.common.decoder import MLP, DecoderConfig, FeedForwardFactory
from titanrl.models.qwen3.model import Qwen3Config, Qwen3ForCausalLM

MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE hyper-parameters: the dense fields plus the experts', named as in config.json."""

    HF_ARCHITECTURE: ClassVar[str] = MOE_ARCHITECTURE
    HF_MODEL_TYPE: ClassVar[str] = "qwen3_moe"
    FAMILY: ClassVar[str] = "Qwen3-MoE"
    HF_ALIASES: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}

    num_experts: int = 8
    """Experts in each sparse layer."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 64
    """Hidden width of each expert's SwiGLU."""
    norm_topk_prob: bool = True
    """Renormalise the k routing weights to sum to one (Qwen3-30B-A3B: true; HF's default: false)."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense MLP (of `intermediate_size`) whatever decoder_sparse_step says."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing auxiliary loss (HF's Switch-style loss) in the training loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts <= 0:
            raise ValueError(f"Qwen3MoeConfig.num_experts must be positive, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3MoeConfig.{name} must be positive, got {getattr(self, name)}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"Qwen3MoeConfig.mlp_only_layers names layers {bad} outside 0..{self.num_hidden_layers - 1}")
        self.mlp_only_layers = sorted(set(self.mlp_only_layers))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> Qwen3MoeConfig:
        """Reads config.json as transformers' Qwen3MoeConfig does: its spelling `num_local_experts`
        of num_experts, and its defaults (`HF_DEFAULTS`) for the fields the file leaves out."""
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError("config.json sets shared_expert_intermediate_size: shared experts (Qwen2-MoE) "
                             "are not supported by TitanRL's Qwen3-MoE")
        hf = canonical_hf_dict(hf)
        if hf.get("mlp_only_layers") is None:
            hf.pop("mlp_only_layers", None)
        return super().from_hf_dict({**HF_DEFAULTS, **hf})  # type: ignore[return-value]

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has experts (HF's rule)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> list[int]:
        """Indices of the layers with experts."""
        return [i for i in range(self.num_hidden_layers) if self.is_sparse(i)]


HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
    num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768,
    tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
)
"""transformers' Qwen3MoeConfig defaults (5.19), which a config.json that leaves a field out means.
They differ from this dataclass's (sized for tests): reading the file with ours would compute
another function (norm_topk_prob, tie_word_embeddings, rope_theta above all)."""

HF_ALIASES = {"num_local_experts": "num_experts"}
"""config.json spellings of our fields: transformers 5 writes num_experts as num_local_experts."""


def canonical_hf_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config.json dict with every alias under our field's name (both present and
    different is refused, naming them)."""
    out = dict(hf)
    for alias, name in HF_ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            raise ValueError(f"config.json sets both {name}={out[name]!r} and {alias}={value!r}: keep one")
        out[name] = value
    return out


def stacked_expert_name(name: str) -> tuple[str, str] | None:
    """`...mlp.experts.gate_proj` -> (`...mlp.experts`, `gate_proj`); None for any other name."""
    m = _STACKED.match(name)
    return (m["prefix"], m["proj"]) if m else None


def expert_checkpoint_name(name: str, expert: int) -> str:
    """The checkpoint tensor holding row `expert` of the stacked parameter `name`."""
    parts = stacked_expert_name(name)
    if parts is None:
        raise ValueError(f"{name!r} is not a stacked expert parameter")
    return f"{parts[0]}.{expert}.{parts[1]}.weight"


def parse_expert_checkpoint_name(ckpt_name: str) -> tuple[str, int] | None:
    """`...mlp.experts.3.up_proj.weight` -> (`...mlp.experts.up_proj`, 3); None for any other name."""
    m = _PER_EXPERT.match(ckpt_name)
    return (f"{m['prefix']}.{m['proj']}", int(m["expert"])) if m else None


@dataclass
class Routing:
    """One sparse layer's routing of N tokens."""

    logits: torch.Tensor
    """Router scores [N, E], float32 (the auxiliary loss and the load metrics read them)."""
    chosen: torch.Tensor
    """Chosen experts [N, k], int64, in descending score order (replayed ones as recorded)."""
    weights: torch.Tensor
    """Combine weights [N, k], float32: the chosen experts' softmax probabilities (renormalised
    with norm_topk_prob); they carry the router's gradient, replayed or not."""
    live_experts: torch.Tensor | None = None
    """The experts this router itself chose [N, k] (equal to `chosen` unless replayed): what
    the trainer compares with the generator's routing (moe/route_agreement)."""


class Router(nn.Module):
    """Top-k softmax router (`mlp.gate`): weight [E, D], scores in float32.

    Two hooks serve router replay: `replay` (set by the trainer for one forward) makes the
    layer route through given experts [N, k] (rows holding -1 are routed live) while the weights
    still come from this router's own probabilities, so the router keeps its gradient; `capture` (the generator's recorder)
    is called with each forward's chosen experts. `last_routing` keeps the latest forward's
    routing for the auxiliary loss and the metrics when `keep_routing` is set.

    `expert_bias` [E] (float32, zeros unless the trainer balances load without an auxiliary
    loss, `train.moe.load_balance='bias'`) is added to the probabilities for the top-k choice
    only, never to the combine weights (DeepSeek-V3's auxiliary-loss-free balancing). It is a
    non-persistent buffer: HF checkpoints have no such tensor, so state_dict (HF files, shape
    checks, exports) leaves it out; training checkpoints and weight pushes carry it by name
    (`routing_buffers`).
    """

    def __init__(self, config: Qwen3MoeConfig, layer_id: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.layer_id = layer_id
        self.batch_invariant = False
        self.replay: torch.Tensor | None = None
        self.capture: Callable[[int, torch.Tensor], None] | None = None
        self.keep_routing = False
        self.last_routing: Routing | None = None
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32), persistent=False)

    def shift_expert_bias(self, delta_E: torch.Tensor) -> None:
        """Moves the load-balancing bias by `delta_E` (the trainer's auxiliary-loss-free update)."""
        self.expert_bias += delta_E.to(self.expert_bias.device, torch.float32)

    def forward(self, x_ND: torch.Tensor) -> Routing:
        x32, w32 = x_ND.float(), self.weight.float()
        # Batch-invariant mode decides top-k on identical bits in trainer and generator.
        logits = kernels.linear(x32, w32) if self.batch_invariant else F.linear(x32, w32)
        probs = torch.softmax(logits, dim=-1)
        # A zero bias leaves the choice (and the weights' bits) as plain top-k of the probabilities.
        experts = torch.topk(probs + self.expert_bias.float(), self.top_k, dim=-1).indices
        live_experts = experts
        weights = probs.gather(1, experts)
        if self.replay is not None:
            if self.replay.shape != (x_ND.shape[0], self.top_k):
                raise ValueError(f"router replay for layer {self.layer_id}: expected experts of shape "
                                 f"{(x_ND.shape[0], self.top_k)}, got {tuple(self.replay.shape)}")
            replay = self.replay.to(device=x_ND.device, dtype=torch.long)
            # A row with any -1 was not recorded (a prompt token served from the prefix cache, a
            # pad): it is routed live.
            recorded = (replay >= 0).all(dim=-1, keepdim=True)
            experts = torch.where(recorded, replay, experts)
            weights = probs.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routing = Routing(logits=logits, chosen=experts, weights=weights, live_experts=live_experts)
        if self.capture is not None:
            self.capture(self.layer_id, experts)
        if self.keep_routing:
            self.last_routing = routing
        return routing


def grouped_mm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: this torch has it, and every row of x
    and the weights is 16-byte aligned (it refuses other strides)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, *weights)) and all(
        t.shape[-2] * t.element_size() % 16 == 0 for t in weights
    )


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with stacked weights, run over expert-sorted tokens.

    `forward(x_sorted [M, D], counts [E_local])` takes tokens grouped by expert, `counts[e]` of
    them for local expert e in order, and returns each one's expert output [M, D]. Expert
    parallelism gives a rank a contiguous range of the experts (dim 0 of every weight).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.batch_invariant = False
        self.implementation = "auto"
        """'auto' (grouped matmul where it applies), 'grouped_mm' or 'loop' (one matmul per expert)."""

    def forward(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if isinstance(gate, DTensor):  # expert parallelism: this rank's experts (counts_E is theirs)
            gate, up, down = gate.to_local(), up.to_local(), down.to_local()
        if gate.dtype != x_MD.dtype:  # a compute-dtype cast of the stacked weights (mixed precision)
            gate, up, down = gate.to(x_MD.dtype), up.to(x_MD.dtype), down.to(x_MD.dtype)
        use_grouped = not self.batch_invariant and self.implementation != "loop" and (
            self.implementation == "grouped_mm" or grouped_mm_available(x_MD, gate, down)
        )
        if use_grouped:
            offsets = torch.cumsum(counts_E, 0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x_MD, gate.transpose(1, 2), offs=offsets))
            h = h * torch._grouped_mm(x_MD, up.transpose(1, 2), offs=offsets)
            return torch._grouped_mm(h, down.transpose(1, 2), offs=offsets)
        return self._loop(x_MD, counts_E, gate, up, down)

    def _loop(self, x_MD: torch.Tensor, counts_E: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
        outputs, start = [], 0
        for e, count in enumerate(counts_E.tolist()):
            x = x_MD[start:start + count]
            start += count
            if self.batch_invariant:
                h = kernels.silu_gate(kernels.linear(x, gate[e]), kernels.linear(x, up[e]))
                outputs.append(kernels.linear(h, down[e]))
            else:
                outputs.append(F.linear(F.silu(F.linear(x, gate[e])) * F.linear(x, up[e]), down[e]))
        return torch.cat(outputs) if outputs else x_MD.new_zeros(0, x_MD.shape[-1])


def sort_by_expert(experts_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the stable permutation that sorts the N*k token slots by expert, and the
    slot count of each expert [E]."""
    flat = experts_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


class SparseMoeBlock(nn.Module):
    """A sparse layer's `mlp`: route, run the chosen experts, combine with the routing weights.

    `dispatch` runs the experts over expert-sorted tokens; the default is this rank's
    `experts`, and expert parallelism replaces it with an all-to-all over the ep group.
    """

    def __init__(self, config: Qwen3MoeConfig, layer_id: int) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = Router(config, layer_id)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.dispatch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def expert_module(self) -> GroupedExperts:
        """The stacked experts (what expert parallelism shards on dim 0 and FSDP wraps on its own mesh)."""
        return self.experts

    def set_router_grad_group(self, group: object | None) -> None:
        """The group the router's gradient is summed over (the tp ranks when they route shards of
        the tokens under expert parallelism); None: none."""
        self.gate.grad_sum_group = group

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        routing = self.gate(x_ND)
        k = routing.chosen.shape[1]
        order, counts = sort_by_expert(routing.chosen, self.num_experts)
        x_sorted = x_ND[order // k]
        run = self.experts if self.dispatch is None else self.dispatch
        y_sorted = run(x_sorted, counts)
        # Un-sort into [N, k, D] (a gather through the inverse permutation), then a fixed-order sum.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y_NKD = y_sorted[inverse].view(-1, k, D)
        y_ND = (y_NKD * routing.weights.to(y_NKD.dtype)[..., None]).sum(dim=1)
        return y_ND.view(B, T, D)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """The Qwen3 decoder with a `SparseMoeBlock` as `mlp` in every sparse layer (HF's rule)."""

    config: Qwen3MoeConfig

    @staticmethod
    def feed_forward_factory(config: DecoderConfig) -> FeedForwardFactory:
        assert isinstance(config, Qwen3MoeConfig)

        def feed_forward(layer_idx: int) -> nn.Module:
            if config.is_sparse(layer_idx):
                return SparseMoeBlock(config, layer_idx)
            return MLP(config)

        return feed_forward

    def routers(self) -> list[Router]:
        """Every sparse layer's router, in layer order."""
        return routers(self)


EXPERT_BIAS = "expert_bias"
"""Name of the routers' load-balancing bias buffer (`Router.expert_bias`)."""


def routers(module: nn.Module) -> list[Router]:
    """The routers inside `module` (a whole model or a pipeline stage), in layer order."""
    return [m for m in module.modules() if isinstance(m, Router)]


def zero_routing_buffers(module: nn.Module, device: torch.device | str | None = None) -> None:
    """Sets every router bias in `module` to float32 zeros (on `device`, default its router's
    weight's): after `to_empty`, which leaves buffers uninitialised, or a dtype cast of the model."""
    for router in routers(module):
        where = router.weight.device if device is None else device
        router.expert_bias = torch.zeros(router.expert_bias.shape[0], dtype=torch.float32, device=where)


def routing_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s router biases by full name (`model.layers.{i}.mlp.gate.expert_bias`): the
    non-parameter tensors training checkpoints save and weight pushes carry."""
    return {name: buf for name, buf in module.named_buffers() if name.rpartition(".")[2] == EXPERT_BIAS}
