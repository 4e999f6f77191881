"""Full, HF-named tensors out of a sharded model, one parameter at a time, for weight publishing.

In a single process the "full tensors" are the parameters themselves (views, no copy).
Rank 0 receives every full tensor and yields them in buckets; the other ranks take part in the
gathers (FSDP / TP shards: DTensor.full_tensor(); other pipeline stages: point-to-point sends
to rank 0) and yield nothing. Only one bucket of full tensors exists at a time, next to the
ranks' own shards: never a second full copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titanrl.models.architectures import build_model, spec_for
from titanrl.models.common.lora import LoraLinear, adapter_parameters, lora_modules, merge_factors
from titanrl.trainer.parallel.mesh import coord, global_rank
from titanrl.trainer.parallel.parallelize import ParallelModel
from titanrl.models.common.pipeline_stage import stage_of_layer
from titanrl.weight_sync.layout import WeightLayout, build_layout

Bucket = list[tuple[str, torch.Tensor]]
HostCopy = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""Host copies of a list of device tensors, in order."""


_SHAPES: dict[str, list[tuple[str, torch.Size]]] = {}
"""hf_parameter_shapes by repr(config): building even a meta model costs ~10 ms (a 25M model), on
the critical path of every weight push (a shared-memory push of that model takes ~15 ms)."""


def hf_parameter_shapes(pm: ParallelModel) -> list[tuple[str, torch.Size]]:
    """Names and shapes of the full model's parameters in HF order (tied LM head omitted, as in HF files)."""
    key = repr(pm.config)
    if key not in _SHAPES:
        with torch.device("meta"):
            ref = build_model(pm.config)
        _SHAPES[key] = [(n, p.shape) for n, p in ref.named_parameters()]  # a tied weight is listed once
    return list(_SHAPES[key])


def _owner_stage(name: str, pm: ParallelModel) -> int:
    n = pm.num_stages
    adapter = spec_for(pm.config).state_dict_adapter
    if adapter.is_embedding(name):
        return 0
    layer = adapter.layer_index(name)
    if layer is not None:
        return stage_of_layer(layer, pm.config.num_hidden_layers, n)
    return n - 1


def _stage_leader(pm: ParallelModel, pp_rank: int) -> int:
    """Global rank at pipeline index `pp_rank` with every other mesh coordinate 0."""
    if pm.mesh is None:
        return 0
    ranks = pm.mesh.mesh
    if "pp" in pm.mesh.mesh_dim_names:
        ranks = ranks.select(pm.mesh.mesh_dim_names.index("pp"), pp_rank)
    return int(ranks.flatten()[0])


def _iter_full(pm: ParallelModel, pick: Callable[[nn.Parameter], torch.Tensor | None], bucket_bytes: int,
               dtype: torch.dtype | None = None, to_host: HostCopy | None = None,
               merged: bool = False) -> Iterator[Bucket]:
    """merged: a LoRA-adapted linear's tensor is its merged weight (in `dtype`, cast before the
    merge as its mixed-precision forward does) instead of the frozen base parameter."""
    me = global_rank()
    local = dict(pm.named_parameters())
    dtype = dtype or next(iter(local.values())).dtype
    adapted = {f"{n}.weight": m for part in pm.parts for n, m in lora_modules(part).items()} if merged else {}
    my_pp = coord(pm.mesh, "pp")
    bucket: Bucket = []
    size = 0
    for name, shape in hf_parameter_shapes(pm):
        owner = _owner_stage(name, pm) % pm.parallel.pp
        full = None
        if my_pp == owner:
            if name in adapted:
                t = _full_merged_weight(adapted[name], dtype)
            else:
                t = pick(local[name])
            if t is None:
                raise ValueError(f"{name} has no gradient to gather (was accumulate_gradients called?)")
            t = t.detach().to(dtype)  # cast the shard before the gather: fewer bytes to move
            full = t.full_tensor() if isinstance(t, DTensor) else t
        if owner != 0:
            src = _stage_leader(pm, owner)
            if me == src:
                dist.send(full.contiguous(), dst=0)
            elif me == 0:
                full = torch.empty(shape, dtype=dtype, device=pm.device)
                dist.recv(full, src=src)
        if me == 0:
            bucket.append((name, full))
            size += full.numel() * full.element_size()
            if size >= bucket_bytes:
                yield _on_host(bucket, to_host)
                bucket, size = [], 0
        del full
    if me == 0 and bucket:
        yield _on_host(bucket, to_host)


@torch.no_grad()
def _full_merged_weight(m: LoraLinear, dtype: torch.dtype) -> torch.Tensor:
    """The full merged weight of an adapted linear: W, A and B each cast to `dtype` (as the
    forward's casts), gathered whole from their shards (FSDP / TP), then merged by the forward's
    op order (`merge_factors`) on the full tensors: the bits an FSDP forward, which merges the
    gathered factors, computes with. In one process these are the parameters themselves."""
    w, a, b = (_full(t.detach().to(dtype)) for t in (m.base_weight, m.lora_A.weight, m.lora_B.weight))
    return merge_factors(w, a, b, m.scale)


def full_adapters(parts: list[nn.Module], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every adapter factor of `parts` (`<linear>.lora_A.weight`, `<linear>.lora_B.weight`), whole on
    every rank (call on every rank: a sharded factor is all-gathered), cast to `dtype` (None: as held).
    In one process the tensors are the parameters' (detached, no copy when no cast)."""
    out = {}
    for part in parts:
        for name, p in adapter_parameters(part).items():
            out[name] = _full(p.detach().to(dtype) if dtype is not None else p.detach())
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _on_host(bucket: Bucket, to_host: HostCopy | None) -> Bucket:
    if to_host is None:
        return bucket
    return list(zip([name for name, _ in bucket], to_host([t for _, t in bucket]), strict=True))


def iter_full_weights(pm: ParallelModel, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None,
                      to_host: HostCopy | None = None) -> Iterator[Bucket]:
    """Buckets of (HF name, full tensor) of at least `bucket_bytes` (the last may be smaller) on rank 0.

    Every rank must iterate it to the end (the others yield nothing but join the collectives).
    dtype: the tensors' dtype (None: the parameters'). A tensor that was not sharded or cast may
    share storage with the live parameter: copy what you keep past the next optimizer step.
    A LoRA-adapted linear (titanrl.models.common.lora) yields its merged weight under the base name.
    to_host: turns each bucket's tensors into host copies (the XLA trainer's `XlaRuntime.to_host`:
    a sharded XLA tensor's own `.cpu()` compiles a program on every call); None yields them as they are.
    """
    yield from _iter_full(pm, lambda p: p, bucket_bytes, dtype, to_host, merged=True)


def iter_full_gradients(pm: ParallelModel, bucket_bytes: int = 64 << 20) -> Iterator[Bucket]:
    """Like iter_full_weights, for the accumulated gradients (checks and debugging)."""
    yield from _iter_full(pm, lambda p: p.grad, bucket_bytes)


class GatheredWeights:
    """The trainer's weights as a `titanrl.weight_sync` source: full tensors gathered bucket by
    bucket to rank 0 as a sender reads them (every rank iterates; the others get nothing), in
    `dtype` (the generator's: float32 master weights go out as their bf16 cast under mixed precision).

    On a GPU they are device tensors; each sender copies a tensor off the device once (or, for
    an NCCL broadcast, sends it from there). On XLA they are host copies (`to_host`), made a bucket at a time.

    `extra` are tensors that are not parameters, sent after them as they are (the routers'
    float32 expert biases with train.moe.load_balance='bias'; replicated, so rank 0 holds them).
    """

    def __init__(self, pm: ParallelModel, dtype: torch.dtype, gather_bucket_bytes: int = 64 << 20,
                 extra: dict[str, torch.Tensor] | None = None, to_host: HostCopy | None = None) -> None:
        self.pm, self.dtype, self.gather_bucket_bytes = pm, dtype, gather_bucket_bytes
        self.extra = extra or {}
        self.to_host = to_host

    def layout(self) -> WeightLayout:
        specs = [(name, shape, self.dtype) for name, shape in hf_parameter_shapes(self.pm)]
        specs += [(name, t.shape, t.dtype) for name, t in self.extra.items()]
        return build_layout(specs)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in iter_full_weights(self.pm, self.gather_bucket_bytes, self.dtype, self.to_host):
            yield from bucket
        if global_rank() == 0:
            yield from self.extra.items()
