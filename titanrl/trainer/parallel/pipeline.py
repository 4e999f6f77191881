"""Pipeline parallel: the decoder split into consecutive stages, run by torch.distributed.pipelining.

A stage module keeps Hugging Face parameter names (`model.layers.5.mlp.up_proj.weight` stays
that on whichever stage holds layer 5), so distributed checkpoints and weight publishing see
the same names in every layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from titanrl.config.schema import ParallelConfig
from titanrl.models.common.decoder import DecoderForCausalLM, LMHead
from titanrl.trainer.parallel.ring_attention import ContextLayout
from titanrl.config.parallel import PP_SCHEDULES


def num_stages(parallel: ParallelConfig) -> int:
    return parallel.pp * PP_SCHEDULES[parallel.pp_schedule] if parallel.pp > 1 else 1


def stages_of_rank(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Stage indices run by pipeline rank `pp_rank`: one, or r and r + pp when interleaved."""
    return [pp_rank + k * parallel.pp for k in range(num_stages(parallel) // parallel.pp)]


def stage_of_layer(layer: int, num_layers: int, n_stages: int) -> int:
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

    def __init__(self, model: DecoderForCausalLM, stage: int, n_stages: int, context: ContextLayout | None) -> None:
        super().__init__()
        num_layers = model.config.num_hidden_layers
        per = num_layers // n_stages
        self.config = model.config
        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == n_stages - 1
        self.context = context
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

    def layers(self) -> list[nn.Module]:
        return list(self.model.layers.values())

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
        pos = self.context.positions(T, h.device) if self.context else torch.arange(T, device=h.device)
        cos, sin = self.model.rotary_emb(pos.expand(B, T), h.dtype)
        for layer in self.model.layers.values():
            h = layer(h, cos, sin)
        return self.model.norm(h) if self.is_last else h


def build_schedule(parts: list[PipelineStageModel], parallel: ParallelConfig, mesh: DeviceMesh,
                   device: torch.device, n_microbatches: int, loss_fn):
    """A fresh pipeline schedule over this rank's stages (shapes are inferred on its first step)."""
    group = mesh["pp"].get_group()
    n = num_stages(parallel)
    stages = [PipelineStage(part, part.stage, n, device, group=group) for part in parts]
    if parallel.pp_schedule == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[parallel.pp_schedule]
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
