"""`train.compile`: each decoder block through `torch.compile` (regional compilation).

The eager block spends a third of a CPU step outside its matmuls, in chains of memory-bound
elementwise ops (RMSNorm, rotary, SiLU-and-mul) and their backward, each reading and writing
the whole activation. Inductor fuses each chain, forward and backward, into one loop. One block
class means one compiled graph that every layer reuses (the parameters are graph inputs), so
the compile cost does not grow with depth; sizes are compiled symbolic (`dynamic=True`), so a
packed micro-batch of another length reuses it too.

`nn.Module.compile` compiles in place: module and parameter names stay Hugging Face's, and
checkpoints, weight pushes and FSDP's wrapping see the same modules. Applied after tensor and
expert parallelism and before FSDP, as TorchTitan orders it.

Two parts of a block stay eager (a graph break around each, `EAGER_PARTS`): the attention
backend, whose kernel is a library one already and whose packed layout (sequence boundaries,
the longest length) changes with every micro-batch, which would recompile the block each step;
and a mixture-of-experts layer's experts, whose per-expert token counts are data (and whose
grouped matmul has no float32 meta kernel for the compiler to trace).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

EAGER_PARTS = ("self_attn.backend", "mlp.experts")
"""Submodules of a decoder block (where it has them) that run eagerly inside the compiled block."""


def apply_compile(layers: Sequence[nn.Module]) -> None:
    """Compiles each decoder block of `layers` in place (`torch.compile(dynamic=True)`), all but
    its `EAGER_PARTS`."""
    for layer in layers:
        for path in EAGER_PARTS:
            try:
                part = layer.get_submodule(path)
            except AttributeError:  # a dense block has no experts
                continue
            part.forward = torch.compiler.disable(part.forward)  # on the instance: names unchanged
        layer.compile(dynamic=True)
