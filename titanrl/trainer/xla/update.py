"""The optimizer update of the XLA step without a host round trip.

The CPU trainer reads loss and gradient norm and skips the update when either is not finite. On
XLA that read would end the traced program before the update, so the update is traced anyway and
each parameter and moment keeps its old value where the device-side flag says so: one program
holds forward, backward and AdamW. What AdamW keeps on the host (its step counters) is put back
once the flag has been read (`undo`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


@torch.no_grad()
def masked_step(optimizers: list[torch.optim.Optimizer], take: torch.Tensor,
                shard_like: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[], None]:
    """Steps every optimizer, keeping parameters and tensor state where `take` (a device bool) is
    False; returns the host-side undo to call when the flag turned out False.
    shard_like(state, p) gives a new moment its parameter's sharding (so the first step's program
    takes the inputs every later one does)."""
    before: list[tuple[torch.Tensor, torch.Tensor]] = []
    fresh: list[tuple[torch.optim.Optimizer, torch.Tensor]] = []
    counters: list[torch.Tensor] = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # clone() of a lazy tensor is a graph node, not a copy made now.
                before.append((p, p.detach().clone()))
                state = opt.state[p]
                if not state:
                    fresh.append((opt, p))
                    state.update(initial_state(p, group))
                    for value in state.values():
                        if value.device == p.device:
                            shard_like(value, p)
                for key, value in state.items():
                    if not torch.is_tensor(value):
                        continue
                    if value.device.type == "cpu":
                        counters.append(value)  # the step count: host-side, undone below
                    else:
                        before.append((value, value.clone()))
    for opt in optimizers:
        opt.step()
    for tensor, old in before:
        tensor.copy_(torch.where(take, tensor, old))

    def undo() -> None:
        for count in counters:
            count -= 1
        for opt, p in fresh:
            opt.state.pop(p, None)

    return undo


def initial_state(p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
    """AdamW's state before its first step, as AdamW would create it, but as device data (zeros
    sent from the host): created inside the trace, the first step would be a program of its own."""
    zeros = lambda: torch.zeros(p.shape, dtype=p.dtype).to(p.device)  # noqa: E731
    state = {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros()}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = zeros()
    return state
