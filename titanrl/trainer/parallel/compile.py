"""`train.compute.compile`: each decoder block through `torch.compile` (regional compilation).

The eager block spends a third of a CPU step outside its matmuls, in chains of memory-bound
elementwise ops (RMSNorm, rotary, SiLU-and-mul) and their backward, each reading and writing
the whole activation. Inductor fuses each chain, forward and backward, into one loop. One block
class means one compiled graph that every layer reuses (the parameters are graph inputs), so
the compile cost does not grow with depth; sizes are compiled symbolic (`dynamic=True`), so a
packed micro-batch of another length reuses it too.

`nn.Module.compile` compiles in place: module and parameter names stay Hugging Face's, and
checkpoints, weight pushes and FSDP's wrapping see the same modules. Applied after tensor and
expert parallelism and before FSDP, as TorchTitan orders it.

Two parts of a block stay eager (a graph break around each, the plan's `eager_parts`): the attention
backend, whose kernel is a library one already and whose packed layout (sequence boundaries,
the longest length) changes with every micro-batch, which would recompile the block each step;
and a mixture-of-experts layer's experts, whose per-expert token counts are data (and whose
grouped matmul has no float32 meta kernel for the compiler to trace).

Inductor's CPU kernels take their thread count at run time (`cpp.dynamic_threads`), not the one
`torch.get_num_threads()` gave at compile time: a block compiled while the trainer ran 1 thread
(`train.compute.threads_when_rollouts_idle`, during generation) was otherwise single-threaded for good,
with no OpenMP region at all, when the idle workers' cores came free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

INDUCTOR_OPTIONS = {"cpp.dynamic_threads": True}
"""Inductor settings of every compiled block (see the module docstring)."""


def apply_compile(layers: Sequence[nn.Module], eager_parts: Sequence[str]) -> None:
    """Compiles each decoder block of `layers` in place (`torch.compile(dynamic=True)` with
    `INDUCTOR_OPTIONS`), all but its `eager_parts` (the spec's `parallel_plan.eager_parts`)."""
    for layer in layers:
        for path in eager_parts:
            try:
                part = layer.get_submodule(path)
            except AttributeError:  # a dense block has no experts
                continue
            part.forward = torch.compiler.disable(part.forward)  # on the instance: names unchanged
        layer.compile(dynamic=True, options=INDUCTOR_OPTIONS)
