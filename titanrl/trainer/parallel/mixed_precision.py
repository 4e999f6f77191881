"""Mixed precision without FSDP: float32 master weights, forward and backward on compute-dtype casts.

FSDP2 layouts get `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)` (fsdp.py).
A layout without FSDP (one process, tp-only, pp-only) gets the same policy here: while a module
of the part runs its forward, every parameter below it is replaced by a cast to the compute
dtype (`p.to(compute)`, recorded by autograd), and put back when the forward returns. So the
matmuls see compute-dtype weights, the gradient arrives at the float32 parameter through the
cast's backward (upcast there, accumulated in float32 over micro-batches, as FSDP2 accumulates
in its reduce dtype), and the optimizer keeps float32 state. Not torch.autocast: autocast picks
dtypes per op (and skips our custom kernels), FSDP casts the parameters; this does as FSDP.

The outermost module whose forward runs casts its whole subtree once, so a tied embedding / LM
head matrix is one cast with one gradient, as in FSDP2's root unit. Every module carries the
hook: a forward run outside the part's own (activation checkpointing recomputing a decoder
block during backward) casts the block's weights again, to the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

Slot = tuple[nn.Module, str, nn.Parameter]
"""(module holding the parameter, attribute name, the float32 parameter)."""


def _slots(module: nn.Module) -> list[Slot]:
    """Every parameter slot under `module`; a tied parameter appears once per module holding it."""
    return [
        (owner, name, p)
        for owner in module.modules()
        for name, p in owner._parameters.items()
        if p is not None
    ]


class ComputeDtypeCast:
    """The forward hooks of one model part: parameters cast to `dtype` while a forward runs."""

    def __init__(self, part: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._restore: dict[int, list[list[Slot]]] = {}
        for module in part.modules():
            slots = _slots(module)
            if not slots:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(slots)))
            self.handles.append(module.register_forward_hook(self._post_hook, always_call=True))

    def _pre_hook(self, slots: list[Slot]):  # noqa: ANN202 (a forward pre-hook)
        def cast_in(module: nn.Module, args: tuple) -> None:
            casts: dict[int, torch.Tensor] = {}
            swapped = []
            for owner, name, p in slots:
                if owner._parameters[name] is not p:
                    continue  # an enclosing module's forward has cast it already
                if id(p) not in casts:
                    casts[id(p)] = p.to(self.dtype)
                owner._parameters[name] = casts[id(p)]
                swapped.append((owner, name, p))
            self._restore.setdefault(id(module), []).append(swapped)

        return cast_in

    def _post_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        for owner, name, p in self._restore[id(module)].pop():
            owner._parameters[name] = p

    def remove(self) -> None:
        """Removes the hooks (the parameters are in place between forwards)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def apply_compute_dtype(part: nn.Module, dtype: torch.dtype) -> ComputeDtypeCast:
    """Makes `part` compute in `dtype` over its own (wider) parameters; see the module docstring."""
    params = list(part.parameters())
    if any(p.dtype == dtype for p in params):
        raise ValueError(f"compute dtype {dtype} must differ from the parameters' ({params[0].dtype}): nothing to cast")
    return ComputeDtypeCast(part, dtype)
