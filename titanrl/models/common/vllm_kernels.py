"""vLLM's own CPU kernels for the shared decoder's modules, inside vLLM only (TorchTitan's "overrides").

`apply_vllm_kernels(model)` swaps the classes of our modules for subclasses whose forward calls
the kernels vLLM's built-in Qwen3 runs on CPU, on the same Parameters:

- linear layers through vLLM's CPU GEMM dispatch (`dispatch_cpu_unquantized_gemm`: oneDNN on
  prepacked weights, SGL kernels on AMX, zentorch on Zen), with q/k/v and gate/up packed as
  one matrix each, as vLLM's QKVParallelLinear and MergedColumnParallelLinear do;
- rotary through `_C.rotary_embedding` on a precomputed cos/sin table, as vLLM's
  RotaryEmbedding.forward_cpu does.

RMSNorm (with its residual add) and SiLU-and-mul stay ours: on x86 CPUs vLLM runs their native
PyTorch form too (its `_C.rms_norm` / `fused_add_rms_norm` / `silu_and_mul` are registered for
GPUs and POWER only), and ours compute the same bits. Swapping `_C.rms_norm` in anyway was
measured to move logprobs ~4e-6 away from vLLM's built-in Qwen3; with these overrides they are
equal to it bit for bit (tests/test_vllm_kernel_overrides.py).

Module and parameter names do not change, so checkpoints, `load_weights` and in-place pushes
see the same model. Packed copies go stale when a Parameter is written: `repack_vllm_kernels`
rebuilds those whose weights were written or replaced since they were packed (vLLM calls it after
loading through `process_weights_after_loading`, the worker extension after every push).
LoRA's unmerged form (lora.sync='adapter') packs the frozen base and adds each adapted
projection's `LoraLinear.update` beside the packed GEMM; an adapter push writes A and B alone,
so nothing is repacked. Batch-invariant mode keeps `titanrl.kernels`: every override hands
back to the base class's forward while `batch_invariant` is set. The trainer never sees these
classes; they are applied only by the vLLM wrapper (`titanrl.rollout.vllm.model`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titanrl.models.common.decoder import MLP, Attention, RotaryEmbedding
from titanrl.models.common.lora import LoraLinear

Gemm = Callable[[torch.Tensor], torch.Tensor]


def _c_ops() -> object:
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    return torch.ops._C


def packed_gemm(weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> Gemm:
    """`x -> x @ weight.T (+ bias)` through vLLM's CPU GEMM dispatch on a packed copy of `weight`
    (made now); the bias goes into the kernel as vLLM's own biased layers (Qwen2's q/k/v) pass it."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = nn.Module()  # what the dispatch expects: a layer with `weight` (and `bias`)
    holder.weight = nn.Parameter(weight_NK.detach().contiguous(), requires_grad=False)
    holder.bias = None if bias_N is None else bias_N.detach().contiguous()
    # remove_weight frees `holder.weight` where the kernel keeps its own packed copy; the
    # fallback (torch's F.linear) reads the weight it is passed, so it stays there.
    dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    return lambda x: holder.cpu_linear(x, holder.weight, holder.bias)


def stacked_biases(layers: list[nn.Linear]) -> torch.Tensor | None:
    """The layers' biases end to end (a packed GEMM's bias), None when they have none."""
    if layers[0].bias is None:
        return None
    return torch.cat([layer.bias.detach() for layer in layers])


def stacked_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights stacked along dim 0 (q/k/v, gate/up): a view when they already lie back to back
    in one storage (as a zero-copy shared-memory push leaves them), else a copy (`torch.cat`)."""
    first = weights[0]
    expected = first.data_ptr()
    for w in weights:
        if (w.dtype != first.dtype or w.shape[1:] != first.shape[1:] or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.data_ptr() != expected):
            return torch.cat(weights)
        expected += w.nbytes
    rows = sum(w.shape[0] for w in weights)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def _written(module: nn.Module, tensors: list[torch.Tensor | None]) -> bool:
    """Whether `tensors` were written or replaced since `module` last packed them (in-place pushes
    bump a tensor's version counter; a zero-copy push moves its data), and records them as packed."""
    key = tuple((t.data_ptr(), t._version) if t is not None else None for t in tensors)
    if getattr(module, "_packed_key", None) == key:
        return False
    module._packed_key = key
    return True


def add_adapter_update(out: torch.Tensor, projection: nn.Module, x: torch.Tensor) -> None:
    """Adds an adapted projection's LoRA term to its slice of a packed GEMM's output, in place."""
    if isinstance(projection, LoraLinear):
        out.add_(projection.update(x))


class VllmCpuLinear(nn.Linear):
    """nn.Linear whose forward runs vLLM's CPU GEMM on a packed copy of `weight`."""

    gemm: Gemm | None = None

    def repack(self) -> None:
        if _written(self, [self.weight, self.bias]):
            self.gemm = packed_gemm(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            raise RuntimeError("VllmCpuLinear used before repack_vllm_kernels (no packed weight yet)")
        return self.gemm(x)


class VllmCpuLoraLinear(LoraLinear):
    """An adapted linear (unmerged form) whose frozen base runs vLLM's CPU GEMM, packed."""

    gemm: Gemm | None = None

    def repack(self) -> None:
        if _written(self, [self.base_weight, self._parameters["bias"]]):
            self.gemm = packed_gemm(self.base_weight, self._parameters["bias"])

    def forward(self, x: torch.Tensor, linear=None) -> torch.Tensor:  # type: ignore[override]
        if linear is not None:  # the decoder's own matmul (batch-invariant mode): LoraLinear's forward
            return super().forward(x, linear)
        if self.gemm is None:
            raise RuntimeError("VllmCpuLoraLinear used before repack_vllm_kernels (no packed weight yet)")
        return self.gemm(x) + self.update(x)


class RotaryPositions(NamedTuple):
    """What `VllmRotaryEmbedding` hands the attention override in the `cos` slot: the flat
    positions and the cos/sin table `_C.rotary_embedding` reads (the override pair's contract)."""

    positions_N: torch.Tensor
    cos_sin_cache: torch.Tensor


class VllmRotaryEmbedding(RotaryEmbedding):
    """Returns (RotaryPositions, None) instead of per-token cos/sin: `VllmAttention` rotates
    q and k in place with vLLM's kernel, reading rows of one table built from our `_angles`."""

    cache: torch.Tensor | None = None

    def _table(self, span: int, dtype: torch.dtype) -> torch.Tensor:
        cache = self.cache
        if cache is None or cache.shape[0] < span or cache.dtype != dtype:
            half = self.head_dim // 2
            angles = self._angles(torch.arange(max(span, self.max_positions)))[:, :half]
            cache = self.cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
        return cache

    def forward(self, positions_BT: torch.Tensor, dtype: torch.dtype):  # type: ignore[override]
        if self.batch_invariant:
            return super().forward(positions_BT, dtype)
        positions = positions_BT.reshape(-1).long()
        span = int(positions.max()) + 1 if positions.numel() else 1
        return RotaryPositions(positions, self._table(span, dtype)), None


class VllmAttention(Attention):
    """Attention with one packed q/k/v GEMM and vLLM's rotary kernel."""

    qkv_gemm: Gemm | None = None

    def repack(self) -> None:
        projections = [self.q_proj, self.k_proj, self.v_proj]
        if _written(self, [t for p in projections for t in (p.weight, p.bias)]):
            self.qkv_gemm = packed_gemm(stacked_rows([p.weight for p in projections]), stacked_biases(projections))
        self.qkv_sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]

    def forward(self, x_BTD: torch.Tensor, cos, sin) -> torch.Tensor:  # type: ignore[override]
        if self.batch_invariant or not isinstance(cos, RotaryPositions):
            return super().forward(x_BTD, cos, sin)
        B, T, _ = x_BTD.shape
        D = self.head_dim
        x_ND = x_BTD.reshape(B * T, -1)
        q, k, v = self.qkv_gemm(x_ND).split(self.qkv_sizes, dim=-1)
        for out, projection in ((q, self.q_proj), (k, self.k_proj), (v, self.v_proj)):
            add_adapter_update(out, projection, x_ND)
        if getattr(self, "q_norm", None) is not None:  # new contiguous tensors, rotated in place below
            q = self.q_norm(q.view(B * T, -1, D)).reshape(B * T, -1)
            k = self.k_norm(k.view(B * T, -1, D)).reshape(B * T, -1)
        # Without norms q and k are views into the packed output, rotated in place there (as vLLM's
        # own Llama and Qwen2 do).
        _c_ops().rotary_embedding(cos.positions_N, q, k, D, cos.cos_sin_cache, True)  # in place, neox style
        out_BTHD = self.backend(q.view(B, T, -1, D), k.view(B, T, -1, D), v.reshape(B, T, -1, D))
        return self.o_proj(out_BTHD.reshape(B, T, -1))


class VllmMLP(MLP):
    """SwiGLU with gate and up packed as one GEMM."""

    gate_up_gemm: Gemm | None = None

    def repack(self) -> None:
        projections = [self.gate_proj, self.up_proj]
        if _written(self, [t for p in projections for t in (p.weight, p.bias)]):
            self.gate_up_gemm = packed_gemm(stacked_rows([p.weight for p in projections]), stacked_biases(projections))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return super().forward(x)
        gate, up = self.gate_up_gemm(x).chunk(2, dim=-1)
        add_adapter_update(gate, self.gate_proj, x)
        add_adapter_update(up, self.up_proj, x)
        return self.down_proj(F.silu(gate) * up)


OVERRIDES: dict[type[nn.Module], type[nn.Module]] = {
    Attention: VllmAttention,
    MLP: VllmMLP,
    RotaryEmbedding: VllmRotaryEmbedding,
}
"""Our module class -> its vLLM-kernel override (exact types only: subclasses are left alone)."""


def apply_vllm_kernels(model: nn.Module) -> nn.Module:
    """Swaps our modules for their vLLM-kernel overrides, in place; returns `model`.

    The swaps keep every attribute and Parameter (only the class changes). Linear layers that
    run alone (o_proj, down_proj, lm_head) become `VllmCpuLinear` (`VllmCpuLoraLinear` where
    adapted); q/k/v and gate/up keep their class (their Parameters are what pushes write) and
    run packed in their parent.
    Call `repack_vllm_kernels` after the weights are loaded.
    """
    for module in model.modules():
        override = OVERRIDES.get(type(module))
        if override is not None:
            module.__class__ = override
    for module in model.modules():
        if isinstance(module, VllmAttention):
            _run_alone(module.o_proj)
        if isinstance(module, VllmMLP):
            _run_alone(module.down_proj)
    lm_head = getattr(model, "lm_head", None)
    if type(lm_head) is nn.Linear:
        lm_head.__class__ = VllmCpuLinear
    return model


def _run_alone(linear: nn.Module) -> None:
    """A linear that runs alone (o_proj, down_proj): its packed-GEMM class, an adapted one's too."""
    if type(linear) is nn.Linear:
        linear.__class__ = VllmCpuLinear
    elif type(linear) is LoraLinear and linear.unmerged:
        linear.__class__ = VllmCpuLoraLinear


def repack_vllm_kernels(model: nn.Module) -> int:
    """Rebuilds every packed weight copy from the current Parameters; returns how many."""
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (VllmCpuLinear, VllmCpuLoraLinear, VllmAttention, VllmMLP)):
                module.repack()
                packed += 1
    return packed
