"""Distributed checkpoints that load into any layout (torch.distributed.checkpoint resharding).

Same directory layout as `GRPOTrainer.save_state` (see titanrl.trainer.checkpoint):
`model_optim/` holds {"model": ..., "optim": ...} keyed by HF parameter names, so
`titanrl.trainer.checkpoint.export_hf` reads a checkpoint from any layout. The optimizer state
is saved flattened (`state.<name>.<key>`, `param_groups.<name>.<key>`): every entry is keyed
by one parameter, so pipeline stages, which each hold some parameters and their own optimizer,
save and load their part. GRPOTrainer writes the same flattened form
(`titanrl.trainer.checkpoint.STATE_DICT_OPTIONS`). Checkpoints in the older nested form
(param groups keyed by index) still load: their tensors are taken and the current
param-group settings kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from titanrl.trainer import checkpoint as ckpt_io
from titanrl.trainer.parallel.parallelize import ParallelModel

_OPTIONS = ckpt_io.STATE_DICT_OPTIONS


def _part_states(pm: ParallelModel, optimizers: list[torch.optim.Optimizer]) -> list[tuple[dict, dict]]:
    for opt in optimizers:
        # get_state_dict initialises empty optimizer state with a zero-lr step, skipped when
        # gradients exist: start from none (the caller undoes the initialisation if needed).
        opt.zero_grad(set_to_none=True)
    return [get_state_dict(part, opt, options=_OPTIONS) for part, opt in zip(pm.parts, optimizers, strict=True)]


def save_model_optim(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], path: str | os.PathLike) -> None:
    """DCP-saves {"model", "optim"} of every rank's parts into `path` (call on every rank)."""
    stepped = [bool(opt.state) for opt in optimizers]
    parts = _part_states(pm, optimizers)
    state = {"model": {k: v for m, _ in parts for k, v in m.items()},
             "optim": {k: v for _, o in parts for k, v in o.items()}}
    dcp.save(state, checkpoint_id=str(path))
    for opt, was in zip(optimizers, stepped, strict=True):
        if not was:
            opt.state.clear()  # saving must not change how training continues


def load_model_optim(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], path: str | os.PathLike,
                     optimizer_stepped: bool = True) -> None:
    """Loads a `model_optim/` directory written under any layout (or by GRPOTrainer) into this one.

    optimizer_stepped=False (the checkpoint was saved before any optimizer step) leaves the
    optimizers without state, as GRPOTrainer.load_state does.
    """
    parts = _part_states(pm, optimizers)
    saved_keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    # The older nested optimizer format keys param groups by index ("optim.param_groups.0.lr").
    nested = any(k.startswith("optim.param_groups.0.") for k in saved_keys)
    request = {"model": {k: v for m, _ in parts for k, v in m.items()},
               "optim": {k: v for _, o in parts for k, v in o.items()
                         if not (nested and k.startswith("param_groups."))}}
    dcp.load(request, checkpoint_id=str(path))
    for part, opt, (model_sd, optim_sd) in zip(pm.parts, optimizers, parts, strict=True):
        model_sd = {k: request["model"][k] for k in model_sd}
        optim_sd = {k: request["optim"].get(k, v) for k, v in optim_sd.items()}
        set_state_dict(part, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
        if not optimizer_stepped:
            opt.state.clear()


def save_training_checkpoint(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], out_dir: str | os.PathLike,
                             *, dtype: torch.dtype, tokenizer_dir: str | os.PathLike,
                             trainer_state: dict[str, Any]) -> Path:
    """A full training checkpoint directory in GRPOTrainer.save_state's layout (call on every rank).

    trainer_state: what `trainer_state.pt` holds besides format_version (version, scheduler,
    skip counters, rng, optimizer_stepped); rank 0 writes it and `hf_config/`.
    """
    out = Path(out_dir)
    save_model_optim(pm, optimizers, out / ckpt_io.MODEL_OPTIM_DIR)
    if dist.get_rank() == 0:
        ckpt_io.write_hf_config(out / ckpt_io.HF_CONFIG_DIR, pm.config, dtype, tokenizer_dir)
        torch.save({"format_version": ckpt_io.FORMAT_VERSION, **trainer_state}, out / ckpt_io.TRAINER_STATE_FILE)
    dist.barrier()
    return out
