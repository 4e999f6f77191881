"""Builds a policy's `ParallelModel` from a checkpoint under the trainer's layout: the trainer's
own policy, and the frozen reference policy of the KL penalty (titanrl.trainer.reference)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from titanrl.config.schema import LoraConfig, ParallelConfig
from titanrl.config.validation import lora_targets
from titanrl.models.common.lora import add_adapters
from titanrl.models.common.decoder import DecoderConfig
from titanrl.trainer import checkpoint as ckpt_io
from titanrl.trainer.parallel.parallelize import ParallelModel, parallelize
from titanrl.trainer.parallel.sharded_load import Adapters, build_sharded_policy


def build_policy(source: str | ckpt_io.InitialPolicy, dtype: torch.dtype, parallel: ParallelConfig,
                 mesh: DeviceMesh | None, device_type: str, lora: LoraConfig | None = None, seed: int = 0,
                 **layout_options: Any) -> tuple[ParallelModel, DecoderConfig, str]:
    """This rank's share of the policy in an HF or training checkpoint directory (`source`, or
    its `open_initial_policy` for a parallel layout), in `dtype`; returns it, its config and the
    directory of its tokenizer files. A parallel layout (call on every rank, `mesh` built) reads
    only this rank's shards; one process loads the whole model onto `device_type`.
    `layout_options` go to `parallelize` (compute dtype, activation checkpointing).
    lora (rank > 0): the loaded weights are frozen and the family's target linears get adapters
    (initialised from `seed`, the same in every layout) before the layout is applied, so casts,
    hooks and the FSDP / TP sharding see them too."""
    if parallel.world_size > 1:
        policy = ckpt_io.open_initial_policy(source) if isinstance(source, str) else source
        adapters = None
        if lora is not None and lora.rank > 0:  # the layouts check_lora lets through: FSDP / HSDP, TP
            adapters = Adapters(lora_targets(lora, policy.config), lora.rank, lora.alpha, seed,
                                unmerged=lora.sync == "adapter")
        pm = build_sharded_policy(policy, dtype, parallel, mesh, adapters, **layout_options)
        return pm, policy.config, policy.tokenizer_dir
    model, config, tokenizer_dir = ckpt_io.load_initial_policy(source, dtype)
    if lora is not None and lora.rank > 0:
        add_adapters(model, lora_targets(lora, config), lora.rank, lora.alpha, seed,
                     unmerged=lora.sync == "adapter")  # as the generators compute (titanrl.models.common.lora)
    return parallelize(model, parallel, None, device_type=device_type, **layout_options), config, tokenizer_dir
