"""Distributed checkpoints that load into any layout (torch.distributed.checkpoint resharding).

Same directory layout as `GRPOTrainer.save_state` (see titanrl.trainer.checkpoint):
`model_optim/` holds {"model": ..., "optim": ...} keyed by HF parameter names, so
`titanrl.trainer.checkpoint.export_hf` reads a checkpoint from any layout. The optimizer state
is saved flattened (`state.<name>.<key>`, `param_groups.<name>.<key>`): every entry is keyed
by one parameter, so pipeline stages, which each hold some parameters and their own optimizer,
save and load their part. `router_bias` holds mixture-of-experts routers' load-balancing bias buffers
(not in the model's state dict, as HF files have no such tensor; replicated on every rank, so
DCP writes each once); a checkpoint without them loads with the biases untouched. GRPOTrainer writes the same flattened form
(`titanrl.trainer.checkpoint.STATE_DICT_OPTIONS`). Each parameter's entry names its param
group (`param_groups.<name>.name`: 'decay' or 'no_decay', see titanrl.trainer.optimizer), so
its group settings (weight decay) load with it in any layout. Older checkpoints, in the nested
form (param groups keyed by index) or flattened with one unnamed group, still load: their
tensors are taken and the current param-group settings kept. A tied embedding / LM head split
across pipeline stages is saved and loaded under the names every other layout uses (see
save_model_optim).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from titanrl.models.common.lora import adapter_parameters
from titanrl.models.qwen3.moe import routing_buffers
from titanrl.trainer import checkpoint as ckpt_io
# A module, not its names: optimizer.py imports this package (the names are read at call time).
from titanrl.trainer import optimizer as param_groups
from titanrl.models.architectures import spec_for
from titanrl.trainer.parallel.mesh import barrier, global_rank
from titanrl.trainer.parallel.parallelize import ParallelModel

_OPTIONS = ckpt_io.STATE_DICT_OPTIONS


def _part_states(pm: ParallelModel, optimizers: list[torch.optim.Optimizer]) -> list[tuple[dict, dict]]:
    for opt in optimizers:
        # get_state_dict initialises empty optimizer state with a zero-lr step, skipped when
        # gradients exist: start from none (the caller undoes the initialisation if needed).
        opt.zero_grad(set_to_none=True)
    return [get_state_dict(part, opt, options=_OPTIONS) for part, opt in zip(pm.parts, optimizers, strict=True)]


def _head_copy_keys(pm: ParallelModel, part: torch.nn.Module) -> dict[str, str]:
    """Prefixes of `part`'s state keys that belong to the last stage's copy of a tied matrix split
    across pipeline stages, each mapped to the HF-named (first stage's) prefix it is saved under."""
    if not (pm.split_tied and getattr(part, "is_last", False)):
        return {}
    adapter = spec_for(pm.config).state_dict_adapter
    return {f"{kind}{adapter.head}": f"{kind}{adapter.embed}" for kind in ("", "state.", "param_groups.")}


def _saved_key(key: str, renames: dict[str, str]) -> str:
    for own, saved in renames.items():
        if key == own or key.startswith(own + "."):
            return saved + key[len(own):]
    return key


def save_model_optim(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], path: str | os.PathLike) -> None:
    """DCP-saves {"model", "optim"} of every rank's parts into `path` (call on every rank).

    A tied matrix is saved as every layout (and GRPOTrainer) saves it: the weight under the
    embedding's and the head's names (readers of tied checkpoints ask for both), its optimizer
    state once, under the embedding's. Split across pipeline stages, the first stage writes the
    embedding and the state, the last stage only the head.
    """
    stepped = [bool(opt.state) for opt in optimizers]
    parts = _part_states(pm, optimizers)
    optim: dict[str, Any] = {}
    for part, (_, o) in zip(pm.parts, parts, strict=True):
        head = _head_copy_keys(pm, part)
        # The head copy's optimizer state equals the embedding's, which the first stage saves.
        optim.update({k: v for k, v in o.items() if _saved_key(k, head) == k})
    state = {"model": {k: v for m, _ in parts for k, v in m.items()}, "optim": optim}
    biases = _router_biases(pm)
    if biases:
        state[ROUTER_BIAS] = biases
    ckpt_io.dcp_save(state, Path(path))
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
    # Param-group settings load only from a checkpoint that names every parameter's group. The
    # older nested format keys param groups by index ("optim.param_groups.0.lr"); the older
    # flattened one has a single group without a name (everything decayed).
    nested = any(k.startswith("optim.param_groups.0.") for k in saved_keys)
    named = any(k.startswith("optim.param_groups.") and k.endswith(f".{param_groups.GROUP_NAME}") for k in saved_keys)
    keep_groups = nested or not named
    # The last stage's copy of a split tied matrix loads from the embedding's entries (weight and
    # optimizer state), which every tied checkpoint holds, whatever layout wrote it.
    renames = [_head_copy_keys(pm, part) for part in pm.parts]
    request: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for head, (m, o) in zip(renames, parts, strict=True):
        request["model"].update({_saved_key(k, head): v for k, v in m.items()})
        request["optim"].update({_saved_key(k, head): v for k, v in o.items()
                                 if not (keep_groups and k.startswith("param_groups."))})
    biases = {k: v for k, v in _router_biases(pm).items() if f"{ROUTER_BIAS}.{k}" in saved_keys}
    if biases:
        request[ROUTER_BIAS] = biases  # loaded in place into the buffers
    ckpt_io.dcp_load(request, Path(path))
    for part, opt, head, (model_sd, optim_sd) in zip(pm.parts, optimizers, renames, parts, strict=True):
        model_sd = {k: request["model"][_saved_key(k, head)] for k in model_sd}
        loaded = {k: request["optim"].get(_saved_key(k, head), v) for k, v in optim_sd.items()}
        optim_sd = {**loaded, **_current_group_settings(optim_sd, loaded, path)}
        set_state_dict(part, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
        if not optimizer_stepped:
            opt.state.clear()


ROUTER_BIAS = "router_bias"
"""The DCP state's key of the routers' expert biases."""


def _router_biases(pm: ParallelModel) -> dict[str, torch.Tensor]:
    return {name: buf for part in pm.parts for name, buf in routing_buffers(part).items()}


def _current_group_settings(current: dict[str, Any], loaded: dict[str, Any], path: Any) -> dict[str, Any]:
    """The param-group entries of `current` (a flattened optimizer state) that must not come from
    the checkpoint: the layout's own choices (LAYOUT_KEYS, e.g. foreach), or all of them when the
    checkpoint put some parameter in another group than this optimizer does."""
    groups = {k: v for k, v in current.items() if k.startswith("param_groups.")}
    moved = [k for k, v in groups.items() if k.endswith(f".{param_groups.GROUP_NAME}") and loaded[k] != v]
    if moved:
        warnings.warn(f"{path}: the checkpoint groups parameters differently for the optimizer (e.g. "
                      f"{moved[0]}={loaded[moved[0]]!r}, here {groups[moved[0]]!r}): keeping this run's "
                      f"param-group settings (weight decay)", stacklevel=3)
        return groups
    return {k: v for k, v in groups.items() if k.rpartition(".")[2] in param_groups.LAYOUT_KEYS}


def load_model_weights(pm: ParallelModel, path: str | os.PathLike) -> None:
    """Loads only the weights of a `model_optim/` directory (any layout's) into this one, each
    rank reading the saved chunks that overlap its shards (call on every rank). LoRA adapter
    factors are left alone: this loads a policy to start from, and a training checkpoint that holds
    adapters is not one (`open_initial_policy` refuses it); a LoRA run initialises its own."""
    renames = [_head_copy_keys(pm, part) for part in pm.parts]
    states = []
    for part in pm.parts:
        adapters = adapter_parameters(part)
        states.append({k: v for k, v in get_model_state_dict(part, options=_OPTIONS).items() if k not in adapters})
    request = {"model": {_saved_key(k, head): v for head, sd in zip(renames, states, strict=True)
                         for k, v in sd.items()}}
    ckpt_io.dcp_load(request, Path(path))
    options = dataclasses.replace(_OPTIONS, strict=not any(adapter_parameters(part) for part in pm.parts))
    for part, head, sd in zip(pm.parts, renames, states, strict=True):
        set_model_state_dict(part, {k: request["model"][_saved_key(k, head)] for k in sd}, options=options)


def save_training_checkpoint(pm: ParallelModel, optimizers: list[torch.optim.Optimizer], out_dir: str | os.PathLike,
                             *, dtype: torch.dtype, tokenizer_dir: str | os.PathLike,
                             trainer_state: dict[str, Any]) -> Path:
    """A full training checkpoint directory in GRPOTrainer.save_state's layout (call on every rank).

    trainer_state: what `trainer_state.pt` holds besides format_version (version, scheduler,
    skip counters, rng, optimizer_stepped); rank 0 writes it and `hf_config/`.
    """
    out = Path(out_dir)
    save_model_optim(pm, optimizers, out / ckpt_io.MODEL_OPTIM_DIR)
    if global_rank() == 0:
        ckpt_io.write_hf_config(out / ckpt_io.HF_CONFIG_DIR, pm.config, dtype, tokenizer_dir)
        torch.save({"format_version": ckpt_io.FORMAT_VERSION, **trainer_state}, out / ckpt_io.TRAINER_STATE_FILE)
    barrier(pm.mesh)
    return out
