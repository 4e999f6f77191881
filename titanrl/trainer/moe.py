"""Mixture-of-experts routing in the trainer's step: router replay, the load-balancing loss, the
routing metrics and the auxiliary-loss-free expert bias.

Per micro-batch `MicroBatchRouting` sets each sparse layer's `Router.replay` to the generator's
recorded experts (laid out like the micro-batch's tokens, [B*T, k], -1 where not recorded), reads
every router's routing once right after the forward (the metrics and the auxiliary loss; no
router keeps its [N, E] scores after that, only a training auxiliary loss's graph does), and
clears the replay only after the backward, so an activation-checkpointed block recomputes the
same routing there.

The auxiliary loss of a micro-batch is HF's over its real tokens, weighted by their share of the
whole batch's real tokens: summed over micro-batches and data-parallel ranks (FSDP sums
gradients) it is a token-weighted mean, as the GRPO loss is. Its load statistics are the
micro-batch's own (as HF computes them per forward), so its value depends on the split.

Which tokens count: a row's *real* tokens are those up to its last trained target (trailing
padding, and trailing tokens that no trained target depends on, excluded); the route agreement
compares completion tokens only (inputs whose previous position is a trained target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanrl.config.schema import TrainConfig
from titanrl.models.common.decoder import DecoderConfig
from titanrl.models.qwen3.moe import Router, routers


@dataclass
class MoeSettings:
    """What the step does for a mixture-of-experts policy (from TrainConfig and the model config)."""

    num_experts: int
    sparse_layers: list[int]
    """Decoder layer index of each sparse layer; position i is `Sample.routed_experts[:, i]`."""
    replay: bool
    """train.moe.router_replay."""
    aux_loss_coef: float
    """Weight of the auxiliary loss in the training loss; 0.0 leaves it out (measured only)."""
    bias_update_rate: float | None
    """train.moe.bias_update_rate with moe_load_balance='bias'; None: no expert bias."""


def moe_settings(cfg: TrainConfig, config: DecoderConfig) -> MoeSettings | None:
    """The step's MoE settings; None for a dense policy."""
    if getattr(config, "num_experts", None) is None:
        return None
    coef = 0.0
    if cfg.moe.load_balance == "aux_loss":
        coef = config.router_aux_loss_coef if cfg.moe.aux_loss_coef is None else cfg.moe.aux_loss_coef
    rate = cfg.moe.bias_update_rate if cfg.moe.load_balance == "bias" else None
    return MoeSettings(config.num_experts, config.sparse_layers, cfg.moe.router_replay, coef, rate)


def real_tokens(mask_BT: torch.Tensor) -> torch.Tensor:
    """Tokens at or before their row's last trained target (bool [B, T])."""
    return mask_BT.flip(1).cummax(1).values.flip(1) > 0


def completion_inputs(mask_BT: torch.Tensor) -> torch.Tensor:
    """Input positions holding a trained completion token: the one after each trained target (bool [B, T])."""
    return F.pad(mask_BT[:, :-1], (1, 0)) > 0


def load_balancing_loss(logits: list[torch.Tensor], experts: list[torch.Tensor], token_mask_N: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """HF's Switch-style auxiliary loss (transformers' `load_balancing_loss_func`) over the masked
    tokens of every layer pooled: E * sum_e f_e * P_e, where f_e is the fraction of (token, slot)
    assignments to expert e and P_e the mean router probability of e, both over (layer, token)
    pairs. `experts` are the layers' chosen experts [N, k] (the routing the forward used: HF's
    live top-k when not replaying); the gradient flows through the probabilities."""
    w = token_mask_N.float()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    for logits_NE, experts_NK in zip(logits, experts, strict=True):
        k = experts_NK.shape[1]
        counts = counts.scatter_add(0, experts_NK.reshape(-1), w.repeat_interleave(k))
        prob_sum = prob_sum + (torch.softmax(logits_NE.float(), dim=-1) * w[:, None]).sum(0)
    rows = (w.sum() * len(logits)).clamp(min=1)  # no token (a row-padding micro-batch): 0, not 0/0
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


class MoeTotals:
    """Per-rank sums of the routing measurements over micro-batches, kept on the device (no
    host sync per layer); the step's stats reduce them over the world."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.num_experts = num_experts
        self.agreement = torch.zeros(3, dtype=torch.float64, device=device)
        """Recorded completion tokens (x sparse layers) whose live top-k set equals the generator's,
        those the forward routed through the generator's experts (all when replaying), and all compared."""
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        """Real tokens' (token, slot) assignments per sparse layer and expert [L, E]."""
        self.aux_loss = 0.0
        """The batch's auxiliary loss: each micro-batch's, weighted by its share of the batch's real tokens."""


@dataclass
class MoeStats:
    """What a gradient pass measured of the routing, over the whole (mini)batch and every rank."""

    route_agreement: float
    """Fraction of recorded completion tokens (per sparse layer) whose trainer top-k set equals
    the generator's, from the trainer's live scores (replayed or not); NaN when none was recorded."""
    tokens_compared: float
    """Completion tokens x sparse layers compared."""
    used_agreement: float
    """The same fraction for the experts the forward used: 1.0 with train.moe.router_replay (the
    replay's check), equal to route_agreement without it."""
    aux_loss: float
    """HF's load-balancing loss of the batch (micro-batch values weighted by real tokens), unscaled."""
    load: torch.Tensor
    """Real tokens' assignments per sparse layer and expert [L, E] (CPU, float64)."""

    @property
    def load_max_over_mean(self) -> float:
        """Max over experts of a layer's assignments divided by their mean, averaged over sparse layers."""
        mean = self.load.mean(1).clamp(min=1e-12)
        return (self.load.max(1).values / mean).mean().item()


class MicroBatchRouting:
    """The routers' hooks around one micro-batch's forward and backward (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, settings: MoeSettings) -> None:
        self.settings = settings
        index = {layer: i for i, layer in enumerate(settings.sparse_layers)}
        self.routers: list[tuple[int, Router]] = [(index[r.layer_id], r) for r in routers(module)]

    def begin(self, routed_BTLK: torch.Tensor | None) -> None:
        """Before the forward: replay the recorded experts (with train.moe.router_replay) and keep the routing."""
        for i, router in self.routers:
            router.keep_routing = True
            if self.settings.replay and routed_BTLK is not None:
                router.replay = routed_BTLK[:, :, i].reshape(-1, routed_BTLK.shape[-1]).long() - 1

    def collect(self, real_BT: torch.Tensor, completion_BT: torch.Tensor, routed_BTLK: torch.Tensor | None,
                real_tokens_total: torch.Tensor, totals: MoeTotals) -> torch.Tensor:
        """After the forward: adds the micro-batch's measurements to `totals` (over its `real_tokens`,
        the agreement over its `completion_inputs`, both laid out like its tokens); returns its
        auxiliary loss weighted by its share of the batch's real tokens (with the graph to the routers)."""
        real_N, completion_N = real_BT.reshape(-1), completion_BT.reshape(-1)
        logits, used = [], []
        for i, router in self.routers:
            routing = router.last_routing
            if routing is None:
                raise RuntimeError(f"router of layer {router.layer_id} did not run in the forward")
            if routing.logits.shape[0] != real_N.numel():
                raise NotImplementedError(
                    f"router of layer {router.layer_id} routed {routing.logits.shape[0]} tokens of a micro-batch of "
                    f"{real_N.numel()}: a layout that splits a micro-batch's tokens inside the layer has no MoE "
                    f"routing metrics, auxiliary loss or replay (set train.moe.load_balance='none')")
            router.keep_routing, router.last_routing = False, None
            logits.append(routing.logits)
            used.append(routing.chosen)
            with torch.no_grad():
                k = routing.chosen.shape[1]
                totals.load[i] += torch.bincount(routing.chosen.reshape(-1), weights=real_N.double().repeat_interleave(k),
                                                 minlength=totals.num_experts)
                if routed_BTLK is not None:
                    recorded_NK = routed_BTLK[:, :, i].reshape(-1, k).long() - 1
                    compare = completion_N & (recorded_NK >= 0).all(-1)
                    recorded_set = recorded_NK.sort(-1).values
                    same = (routing.live_experts.sort(-1).values == recorded_set).all(-1)
                    same_used = (routing.chosen.sort(-1).values == recorded_set).all(-1)
                    totals.agreement += torch.stack([same & compare, same_used & compare, compare]).sum(1)
        weight = real_N.sum() / real_tokens_total.to(real_N.device)
        # Only a loss that trains needs its graph (measured for moe/aux_loss either way).
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.settings.aux_loss_coef > 0):
            aux = load_balancing_loss(logits, used, real_N, self.settings.num_experts) * weight
        totals.aux_loss += aux.item()
        return aux

    def end(self) -> None:
        """After the backward (or on an error): no router replays or keeps anything."""
        for _, router in self.routers:
            router.replay, router.keep_routing, router.last_routing = None, False, None


@torch.no_grad()
def update_expert_bias(module: torch.nn.Module, settings: MoeSettings, load_LE: torch.Tensor) -> None:
    """The auxiliary-loss-free update after an optimizer step (DeepSeek-V3; as TorchTitan does it):
    each expert's bias moves by rate * sign(mean load - its load), the step centred so a layer's
    biases keep mean zero. `load_LE` is the step's global load, equal on every rank, so the
    replicated biases stay equal."""
    assert settings.bias_update_rate is not None
    index = {layer: i for i, layer in enumerate(settings.sparse_layers)}
    for router in routers(module):
        load = load_LE[index[router.layer_id]].to(torch.float32)
        delta = settings.bias_update_rate * torch.sign(load.mean() - load)
        router.shift_expert_bias(delta - delta.mean())
