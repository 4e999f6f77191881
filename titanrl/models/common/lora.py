"""Low-rank adapters (LoRA) on a decoder's linears.

`LoraLinear` takes an `nn.Linear`'s place: the base weight and bias stay under their own names
(`...q_proj.weight`, frozen), beside two trainable factors `...q_proj.lora_A.weight` [r, in]
(Kaiming-uniform) and `...q_proj.lora_B.weight` [out, r] (zeros, so a fresh adapter changes
nothing). It computes in one of two forms, picked by lora.sync so that the trainer and the
generators compute alike and batch-invariant parity stays bitwise:

- merged (lora.sync='merged'): a plain linear with the merged weight W + (alpha / r) * B @ A (one
  addmm). The weight push sends that same tensor under the base name, and the generators hold
  plain linears.
- unmerged (lora.sync='adapter'): x W^T + (alpha / r) * (x A^T) B^T, through the same linear kernel
  for all three matmuls. The generators carry the same modules, a push sends A and B alone
  (well under 1 % of the weights) and lands with no merge.

Autograd would keep each merged weight for the backward of the matmul that used it (a second copy
of every adapted weight for the whole forward). `recompute_merged_weights` stops that: a decoder
block without activation checkpointing runs under it, its saved-tensor hook keeps (module, dtype)
instead and the backward merges again by the same op order, to the forward's bits.

Neither form has a place for dropout on the adapter's input that the generators could mirror
(config validation refuses lora.dropout > 0). `LoraRecord` is what a checkpoint records of the
adapters besides their tensors (trainer_state.pt; the PEFT export's adapter_config.json).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LORA_A = "lora_A"
LORA_B = "lora_B"

LinearKernel = Callable[..., torch.Tensor]
"""A matmul with F.linear's signature: (x [..., K], weight [N, K], bias [N] or None) -> [..., N]."""


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


def initial_a(rank: int, in_features: int, dtype: torch.dtype, generator: torch.Generator | None) -> torch.Tensor:
    """A fresh adapter's A [rank, in] on the CPU: nn.Linear's own initialisation (Kaiming-uniform,
    a=sqrt(5)), drawn from `generator` (B starts at zeros)."""
    a = torch.empty(rank, in_features, dtype=dtype)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


def merge_factors(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """W + (scale * B) @ A as one addmm: the one op order of every merge (`LoraLinear.merged_weight`,
    and a parallel trainer's push of full tensors gathered from shards)."""
    return torch.addmm(w, b * scale, a, out=out)


class LoraFactor(nn.Module):
    """One factor of an adapter: a bare `weight` Parameter (not an nn.Linear, so nothing that
    rewrites linears, e.g. oneDNN or tensor-parallel plans, ever takes it for one)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable low-rank update; computes with the merged weight."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None,
                 unmerged: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.unmerged = unmerged
        """Computes x W^T + s (x A^T) B^T instead of x (W + s B A)^T (module docstring)."""
        # The base linear's Parameters under its names: `weight` is W itself (frozen), never the
        # merged tensor (`merged_weight`).
        self._parameters["weight"] = base.weight.requires_grad_(False)
        self._parameters["bias"] = None if base.bias is None else base.bias.requires_grad_(False)
        w = base.weight
        a = initial_a(rank, self.in_features, w.dtype, generator)
        self.lora_A = LoraFactor(a.to(w.device))
        self.lora_B = LoraFactor(torch.zeros(self.out_features, rank, dtype=w.dtype, device=w.device))

    @property
    def base_weight(self) -> torch.Tensor:
        """The frozen W (as the module holds it now: a compute-dtype cast inside a mixed-precision forward)."""
        return self._parameters["weight"]

    def merged_weight(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """W + (scale * B) @ A, each operand first cast to `dtype` (None: as held), as one addmm
        (into `out` when given: no grad). The merged forward, its backward's recompute and the
        weight push all come here, so they produce the same bits; one fused pass over W is 3-4x
        faster than W + scale * (B @ A) in three (measured at Qwen3-0.6B's shapes on CPU), and its
        bits do not depend on the thread count."""
        w, a, b = self.base_weight, self.lora_A.weight, self.lora_B.weight
        if dtype is not None:
            w, a, b = w.to(dtype), a.to(dtype), b.to(dtype)
        return merge_factors(w, a, b, self.scale, out=out)

    def _forward_merged_weight(self) -> torch.Tensor:
        """The merged weight the merged form's forward computes with (registered for
        `recompute_merged_weights`). Not the `weight` attribute: that is the base Parameter, as
        FSDP2 (which reads each parameter back by its attribute name) and state dicts want it."""
        merged = self.merged_weight()
        recorder = getattr(_recorders, "current", None)
        # A DTensor (tensor parallel: this rank's rows or columns) has no storage of its own to
        # record; autograd keeps it, as the pack hook keeps every tensor subclass.
        if recorder is not None and merged.requires_grad and type(merged) is torch.Tensor:
            recorder.made[merged.untyped_storage().data_ptr()] = (weakref.ref(merged), self)
        return merged

    def forward(self, x: torch.Tensor, linear: LinearKernel = F.linear) -> torch.Tensor:
        """`linear(x, weight, bias)` in this module's form; `linear` is the matmul the decoder uses
        (F.linear, or the batch-invariant kernel)."""
        bias = self._parameters["bias"]
        if not self.unmerged:
            return linear(x, self._forward_merged_weight(), bias)
        return linear(x, self.base_weight, bias) + self.update(x, linear)

    def update(self, x: torch.Tensor, linear: LinearKernel = F.linear) -> torch.Tensor:
        """The unmerged form's adapter term s * (x A^T) B^T (what a generator adds to its own
        matmul of the frozen base: titanrl.models.common.vllm_kernels)."""
        return self.scale * linear(linear(x, self.lora_A.weight), self.lora_B.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


def add_adapters(model: nn.Module, targets: Iterable[str], rank: int, alpha: float, seed: int = 0,
                 unmerged: bool = False) -> list[str]:
    """Freezes every parameter of `model` and wraps each nn.Linear whose leaf name is in `targets`
    in a `LoraLinear` (computing `unmerged` or merged); returns the wrapped modules' names. Adapters
    are initialised in module order from one generator seeded with `seed` (a run's seed gives the
    same adapters every time)."""
    targets = set(targets)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    wrapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in targets:
            model.set_submodule(name, LoraLinear(module, rank, alpha, generator, unmerged))
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


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter factors by parameter name (`...q_proj.lora_A.weight`, `...lora_B.weight`)."""
    return {n: p for n, p in model.named_parameters() if f".{LORA_A}." in n or f".{LORA_B}." in n}



@dataclass(frozen=True)
class _Remerge:
    """What autograd keeps of a merged weight (or a view of it) under `recompute_merged_weights`."""

    module: LoraLinear
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def tensor(self) -> torch.Tensor:
        """The saved view, merged again. The operands are cast to the forward's dtype from the
        parameters as held now (the casts are exact), so the bits equal the forward's."""
        with torch.no_grad():
            merged = self.module.merged_weight(self.dtype)
        return merged.as_strided(self.size, self.stride, self.offset)


class _MergedWeightRecorder:
    """The merged weights made inside one `recompute_merged_weights`, by storage address. Weak
    references: each merged weight is freed as soon as its matmul is done, and a dead reference
    tells an address reused by another tensor from the merged weight that had it."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], LoraLinear]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Remerge:
        if type(t) is not torch.Tensor or t.layout != torch.strided:
            return t  # tensor subclasses (DTensor) and sparse tensors: kept as autograd would
        entry = self.made.get(t.untyped_storage().data_ptr())
        merged = entry[0]() if entry is not None else None
        if merged is None:
            return t
        return _Remerge(entry[1], merged.dtype, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(saved: torch.Tensor | _Remerge) -> torch.Tensor:
        return saved.tensor() if isinstance(saved, _Remerge) else saved


_recorders = threading.local()


@contextlib.contextmanager
def recompute_merged_weights(module: nn.Module) -> Iterator[None]:
    """Runs a forward in which autograd keeps no merged weight of `module`'s adapted linears: the
    backward merges again (one addmm per linear, ~1/(2 x tokens) of the linear's own backward cost).
    A no-op without grad or without merged-form adapters below `module`. Not for a block under activation
    checkpointing: its own saved-tensor hooks already drop everything, and an inner hook would
    replace them."""
    if not torch.is_grad_enabled() or getattr(_recorders, "current", None) is not None \
            or not any(isinstance(m, LoraLinear) and not m.unmerged for m in module.modules()):
        yield
        return
    recorder = _MergedWeightRecorder()
    _recorders.current = recorder
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
            yield
    finally:
        _recorders.current = None
        recorder.made.clear()  # autograd keeps the pack hook (so the recorder) with each saved tensor


def initial_adapters(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full (CPU) factors `add_adapters(..., seed)` gave the adapted linears of `model`, by
    parameter name: what a model whose adapters were added on the meta device (a parallel
    trainer's sharded build) fills its shards from."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in lora_modules(model).items():
        dtype = m.base_weight.dtype
        out[f"{name}.{LORA_A}.weight"] = initial_a(m.rank, m.in_features, dtype, generator)
        out[f"{name}.{LORA_B}.weight"] = torch.zeros(m.out_features, m.rank, dtype=dtype)
    return out
