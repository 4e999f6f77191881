"""Activation checkpointing per decoder block (`train.memory.activation_checkpointing`).

A checkpointed block stores only its inputs during forward and recomputes its internals in
backward (`torch.utils.checkpoint`, non-reentrant: it works under FSDP2, DTensor TP, pipeline
stages and ring attention). The switch is a flag on each `DecoderLayer` instead of a wrapper
module, so parameter names, and with them checkpoints, weight publishing and gathers, stay
Hugging Face's. Recomputation runs the same kernels on the same inputs, so gradients are
bitwise those of the stored activations.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from titanrl.config.schema import ActivationCheckpointing


def checkpointed_layers(num_layers: int, mode: ActivationCheckpointing, every: int) -> list[int]:
    """Indices (0-based, global) of the decoder blocks `mode` checkpoints in a model of `num_layers`."""
    if every < 1:
        raise ValueError(f"train.memory.activation_checkpointing_every must be >= 1, got {every}")
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_layers))
    if mode == "every_nth":
        return [i for i in range(num_layers) if (i + 1) % every == 0]
    raise ValueError(f"unknown train.memory.activation_checkpointing {mode!r}: use 'none', 'full' or 'every_nth'")


def apply_activation_checkpointing(layers: Sequence[nn.Module], mode: ActivationCheckpointing, every: int) -> None:
    """Sets each decoder block's `checkpoint_activations` flag; `layers` is the whole model's stack
    (global indices, so a pipeline stage checkpoints the same blocks as one process would)."""
    chosen = set(checkpointed_layers(len(layers), mode, every))
    for i, layer in enumerate(layers):
        if not hasattr(layer, "checkpoint_activations"):  # a block class that would ignore the flag
            raise TypeError(f"{type(layer).__name__} has no checkpoint_activations flag (see models.qwen3.DecoderLayer)")
        layer.checkpoint_activations = i in chosen
