"""Low-rank adapters (LoRA) on a decoder's linears, computed as one merged weight.

`LoraLinear` takes an `nn.Linear`'s place: the base weight and bias stay under their own names
(`...q_proj.weight`, frozen), beside two trainable factors `...q_proj.lora_A.weight` [r, in]
(Kaiming-uniform) and `...q_proj.lora_B.weight` [out, r] (zeros, so a fresh adapter changes
nothing). Its `weight` is the merged tensor W + (alpha / r) * B @ A, and the forward is a plain
linear with it. The decoder reads `layer.weight` for its batch-invariant matmul, the weight push
sends the same merged tensor under the base name (lora.sync='merged'), and so the trainer scores
tokens with exactly the weights the generators hold: batch-invariant parity stays bitwise.

The merged form has no place for dropout on the adapter's input (config validation refuses
lora.dropout > 0 until the unmerged path exists). `LoraRecord` is what a checkpoint records of the
adapters besides their tensors (trainer_state.pt; the PEFT export's adapter_config.json).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LORA_A = "lora_A"
LORA_B = "lora_B"


@dataclass(frozen=True)
class LoraRecord:
    """What a LoRA policy's checkpoint records besides the tensors: enough to rebuild its adapters
    and to tell PEFT what they sit on."""

    rank: int
    """The adapters' rank r."""
    alpha: float
    """Scale numerator (scale = alpha / rank)."""
    target_modules: tuple[str, ...]
    """Leaf names of the adapted linears."""
    base_model: str
    """The checkpoint the frozen base weights came from (PEFT's base_model_name_or_path)."""

    @property
    def adapters(self) -> tuple[int, float, tuple[str, ...]]:
        """What decides the adapters' tensors (rank, alpha, targets): two records with the same load each other's."""
        return self.rank, self.alpha, self.target_modules

    def to_dict(self) -> dict:
        """Plain types, for trainer_state.pt (weights_only-loadable)."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules),
                "base_model": self.base_model}

    @classmethod
    def from_dict(cls, d: dict) -> LoraRecord:
        return cls(int(d["rank"]), float(d["alpha"]), tuple(d["target_modules"]), str(d["base_model"]))


def describe(record: LoraRecord | None) -> str:
    """A record as the lora settings that make it, for errors ('lora.rank=0' for none)."""
    if record is None:
        return "lora.rank=0"
    return f"lora.rank={record.rank}, lora.alpha={record.alpha}, lora.target_modules={list(record.target_modules)}"


class LoraFactor(nn.Module):
    """One factor of an adapter: a bare `weight` Parameter (not an nn.Linear, so nothing that
    rewrites linears, e.g. oneDNN or tensor-parallel plans, ever takes it for one)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable low-rank update; computes with the merged weight."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        # Registered directly: `weight` is this class's property (the merged tensor), while the
        # base Parameter keeps the base linear's state-dict name.
        self._parameters["weight"] = base.weight.requires_grad_(False)
        self._parameters["bias"] = None if base.bias is None else base.bias.requires_grad_(False)
        w = base.weight
        a = torch.empty(rank, self.in_features, dtype=w.dtype)
        # nn.Linear's own initialisation (Kaiming-uniform, a=sqrt(5)), on the adapter's generator.
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A = LoraFactor(a.to(w.device))
        self.lora_B = LoraFactor(torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device))
        self.merged_cache: torch.Tensor | None = None
        """An inference copy of the merged weight (`cache_merged`: a generator, whose factors change
        only when a push lands); None in the trainer, which merges in every forward (autograd)."""

    @property
    def base_weight(self) -> torch.Tensor:
        """The frozen W (as the module holds it now: a compute-dtype cast inside a mixed-precision forward)."""
        return self._parameters["weight"]

    def merged_weight(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """W + (scale * B) @ A, each operand first cast to `dtype` (None: as held), as one addmm
        (into `out` when given: no grad). The forward, the weight push and a generator's merge
        (`cache_merged`) all come here, so they produce the same bits; one fused pass over W is
        3-4x faster than W + scale * (B @ A) in three (measured at Qwen3-0.6B's shapes on CPU), and
        its bits do not depend on the thread count."""
        w, a, b = self.base_weight, self.lora_A.weight, self.lora_B.weight
        if dtype is not None:
            w, a, b = w.to(dtype), a.to(dtype), b.to(dtype)
        return torch.addmm(w, b * self.scale, a, out=out)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The merged weight the forward computes with (what `nn.Linear.weight` is to the decoder)."""
        return self.merged_cache if self.merged_cache is not None else self.merged_weight()

    def cache_merged(self) -> None:
        """Merges now, by `merged_weight`'s op order, and computes with that copy until the next
        call: a vLLM engine that receives adapters (lora.sync='adapter') calls it after each push."""
        with torch.no_grad():
            cache = self.merged_cache
            base = self.base_weight
            if cache is None or cache.shape != base.shape or cache.dtype != base.dtype:
                cache = torch.empty_like(base)  # after the first push: written in place, no new memory
            self.merged_cache = self.merged_weight(out=cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self._parameters["bias"])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def add_adapters(model: nn.Module, targets: Iterable[str], rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Freezes every parameter of `model` and wraps each nn.Linear whose leaf name is in `targets`
    in a `LoraLinear`; returns the wrapped modules' names. Adapters are initialised in module
    order from one generator seeded with `seed` (a run's seed gives the same adapters every time)."""
    targets = set(targets)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    wrapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in targets:
            model.set_submodule(name, LoraLinear(module, rank, alpha, generator))
            wrapped.append(name)
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """The adapted linears of `model` by module name (empty without LoRA)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def merged_weights(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Each adapted linear's merged weight under its base parameter name (`...q_proj.weight`), no grad."""
    with torch.no_grad():
        return {f"{name}.weight": m.merged_weight(dtype) for name, m in lora_modules(model).items()}


def merge_adapters(model: nn.Module) -> nn.Module:
    """Puts a plain nn.Linear holding the merged weight (and the base bias) back in place of every
    `LoraLinear`, in the base weight's dtype: the model a full HF export writes."""
    for name, m in lora_modules(model).items():
        with torch.no_grad():
            w = m.merged_weight().to(m.base_weight.dtype)
        bias = m._parameters["bias"]
        linear = nn.Linear(m.in_features, m.out_features, bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(w)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach())
        model.set_submodule(name, linear)
    return model


def cache_merged_weights(model: nn.Module) -> int:
    """`LoraLinear.cache_merged` on every adapted linear of `model`; returns how many."""
    modules = lora_modules(model)
    for m in modules.values():
        m.cache_merged()
    return len(modules)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter factors by parameter name (`...q_proj.lora_A.weight`, `...lora_B.weight`)."""
    return {n: p for n, p in model.named_parameters() if f".{LORA_A}." in n or f".{LORA_B}." in n}

