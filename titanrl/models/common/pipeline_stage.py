"""A pipeline stage of the shared decoder: a contiguous run of its blocks, keeping HF names.

A stage module keeps Hugging Face parameter names (`model.layers.5.mlp.up_proj.weight` stays
that on whichever stage holds layer 5), so distributed checkpoints and weight publishing see
the same names in every layout. `titanrl.trainer.parallel.pipeline` builds stages through
`PipelineStageModel` and runs them with torch.distributed.pipelining.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanrl.models.common.decoder import DecoderForCausalLM, LMHead

Positions = Callable[[int, torch.device], torch.Tensor]
"""positions(T, device) -> [T] the positions of this rank's tokens (context parallelism's slice)."""


def stage_of_layer(layer: int, num_layers: int, n_stages: int) -> int:
    """The stage that holds decoder layer `layer` (stages hold equal runs of layers)."""
    return layer // (num_layers // n_stages)


class PipelineStageModel(nn.Module):
    """One pipeline stage of a DecoderForCausalLM: a contiguous run of its decoder layers.

    The first stage maps token ids [B, T] to hidden states (embedding + layers); middle stages
    map hidden states to hidden states; the last one ends with the final norm and returns its
    hidden states [B, T, D]: it holds the LM head, which the step's loss function applies chunk
    by chunk (chunked_logprobs.py), so full logits never exist. Modules are shared with (taken
    from) the full model. With tied embeddings the first and last stages each hold a copy of the
    tied matrix (see tied.py).

    Batch-invariant mode: the shared modules keep the full model's `set_batch_invariant` state;
    `set_batch_invariant` switches them (the loss function's head takes the step's flag).
    """

    def __init__(self, model: DecoderForCausalLM, stage: int, n_stages: int, positions: Positions | None) -> None:
        super().__init__()
        num_layers = model.config.num_hidden_layers
        per = num_layers // n_stages
        self.config = model.config
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == n_stages - 1
        self.positions = positions
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = model.model.embed_tokens
        # A ModuleDict keyed by the global layer index keeps HF parameter names.
        ids = range(stage * per, (stage + 1) * per)
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in ids})
        self.model.rotary_emb = model.model.rotary_emb
        if self.is_last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
            # A tied head is the embedding's matrix; the first stage (on another rank) holds that
            # copy and this stage this one: tied.py keeps the two equal.

    def set_batch_invariant(self, enabled: bool = True) -> PipelineStageModel:
        """DecoderForCausalLM.set_batch_invariant for this stage's modules."""
        for module in self.modules():
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = enabled
        return self

    def decoder_layers(self) -> list[nn.Module]:
        """This stage's blocks, in order."""
        return list(self.model.layers.values())

    def input_embedding(self) -> nn.Embedding | None:
        """The token embedding (first stage only)."""
        return self.model.embed_tokens if self.is_first else None

    def output_head(self) -> nn.Linear | None:
        """The LM head (last stage only)."""
        return self.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor, head: LMHead | None = None) -> Any:
        """The stage's output for input `x`; with `head` (the last stage only), the loss function's
        call `head(x, lm_head.weight)` on hidden states this stage returned: a call of the stage
        module itself, so FSDP gathers the head's weight and mixed precision casts it, as they do
        for the whole model's head (DecoderForCausalLM.forward)."""
        if head is not None:
            if not self.is_last:
                raise RuntimeError(f"pipeline stage {self.stage} holds no LM head")
            return head(x, self.lm_head.weight)
        h = self.model.embed_tokens(x) if self.is_first else x
        B, T = h.shape[:2]
        pos = self.positions(T, h.device) if self.positions else torch.arange(T, device=h.device)
        cos, sin = self.model.rotary_emb(pos.expand(B, T), h.dtype)
        for layer in self.model.layers.values():
            h = layer(h, cos, sin)
        return self.model.norm(h) if self.is_last else h


