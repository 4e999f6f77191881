"""Training checkpoints: the full state for an exact resume, and HF export from one.

Layout of a training checkpoint directory (the caller creates it, e.g. as a temporary
directory that it renames atomically once `GRPOTrainer.save_state` returns):

    model_optim/        torch.distributed.checkpoint (DCP) save of {"model": ..., "optim": ...},
                        fully-qualified-name keyed (get_state_dict), so a sharded trainer can
                        load it with resharding
    trainer_state.pt    torch.save dict (weights_only-loadable): version, lr scheduler, skip
                        counters, RNG states of torch / python `random` / numpy; with LoRA
                        the adapters' rank, alpha, targets and base checkpoint (LORA_STATE_KEY;
                        the model state then holds the frozen base and lora_A / lora_B)
    hf_config/          config.json and tokenizer files of the policy (no weights), so the
                        policy can be rebuilt without the original checkpoint directory

DCP runs here without a process group: with none initialised, `dcp.save/load(no_dist=True)`
is the single-process path (checked on torch 2.13), and `get_state_dict` / `set_state_dict`
need no process group for an unsharded module.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanrl.models.architectures import spec_for
from titanrl.models.hf_checkpoint import (
    TOKENIZER_FILES,
    CheckpointError,
    CheckpointTensors,
    check_shapes,
    checked_tensors,
    empty_meta_model,
    empty_model,
    parameter_shapes,
    read_config,
    save_checkpoint,
)
from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM
from titanrl.models.common.lora import LoraRecord, adapter_parameters, add_adapters, merge_adapters
from titanrl.models.peft_adapter import save_peft_adapter

MODEL_OPTIM_DIR = "model_optim"
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""One optimizer-state format for every layout: flattened per-parameter keys, which pipeline
stages can save and load their own share of (the single-process trainer uses it too)."""
TRAINER_STATE_FILE = "trainer_state.pt"
HF_CONFIG_DIR = "hf_config"
LORA_STATE_KEY = "lora"
"""trainer_state.pt's entry describing a LoRA policy's adapters (`LoraRecord.to_dict`); absent without LoRA."""
FORMAT_VERSION = 1


def no_dist() -> bool:
    """True when DCP must take its single-process path (no process group initialised)."""
    return not (dist.is_available() and dist.is_initialized())


def dcp_save(state: dict[str, Any], path: Path) -> None:
    """dcp.save, single-process when no process group is initialised."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # we asked for no_dist
        dcp.save(state, checkpoint_id=str(path), no_dist=no_dist())


def dcp_load(state: dict[str, Any], path: Path) -> None:
    """dcp.load in place into `state`'s tensors, single-process when no process group is initialised."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=no_dist())


def is_training_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` looks like a training checkpoint directory (not an HF one)."""
    p = Path(path)
    return (p / MODEL_OPTIM_DIR).is_dir() and (p / TRAINER_STATE_FILE).is_file()


def check_training_checkpoint(path: str | os.PathLike) -> Path:
    """The directory as a Path, or a CheckpointError naming what is missing."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"training checkpoint directory {str(p)!r} does not exist")
    for name in (MODEL_OPTIM_DIR, TRAINER_STATE_FILE, HF_CONFIG_DIR):
        if not (p / name).exists():
            raise CheckpointError(
                f"{str(p / name)!r} is missing: a training checkpoint holds {MODEL_OPTIM_DIR}/, "
                f"{TRAINER_STATE_FILE} and {HF_CONFIG_DIR}/ (written by GRPOTrainer.save_state)"
            )
    return p


def write_hf_config(out_dir: Path, config: DecoderConfig, dtype: torch.dtype, tokenizer_dir: str | os.PathLike) -> None:
    """config.json (with the training dtype) and the tokenizer files, no weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = config.to_hf_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)


def read_hf_config(ckpt: Path) -> tuple[DecoderConfig, torch.dtype]:
    """The model config and training dtype stored in `ckpt/hf_config`."""
    config = read_config(ckpt / HF_CONFIG_DIR)
    name = json.loads((ckpt / HF_CONFIG_DIR / "config.json").read_text()).get("torch_dtype", "float32")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{str(ckpt / HF_CONFIG_DIR / 'config.json')!r}: unknown torch_dtype {name!r}")
    return config, dtype


def rng_state() -> dict[str, Any]:
    """Global RNG states (torch CPU, python `random`, numpy), in weights_only-loadable types."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """`trainer_state.pt`, checked for the format this code writes."""
    state = torch.load(ckpt / TRAINER_STATE_FILE, weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{str(ckpt / TRAINER_STATE_FILE)!r} has format_version {state.get('format_version')!r}; "
            f"this TitanRL reads {FORMAT_VERSION}"
        )
    return state


def lora_record(ckpt: Path, state: dict[str, Any] | None = None) -> LoraRecord | None:
    """The LoRA adapters a training checkpoint's policy carries (trainer_state.pt's LORA_STATE_KEY), or
    None; `state`: that trainer_state.pt, when read already."""
    recorded = (read_trainer_state(ckpt) if state is None else state).get(LORA_STATE_KEY)
    return None if recorded is None else LoraRecord.from_dict(recorded)


def load_policy(training_ckpt_dir: str | os.PathLike, merge: bool = True) -> tuple[DecoderForCausalLM, DecoderConfig]:
    """Rebuilds the policy from a training checkpoint: hf_config/ plus the DCP "model" state. A LoRA
    policy's adapters are merged into its linears (the model it computes), or with merge=False
    kept as `LoraLinear`s over the frozen base."""
    ckpt = check_training_checkpoint(training_ckpt_dir)
    config, dtype = read_hf_config(ckpt)
    model = empty_model(config, dtype)
    lora = lora_record(ckpt)
    if lora is not None:
        add_adapters(model, lora.target_modules, lora.rank, lora.alpha)
    state = {"model": get_model_state_dict(model)}
    dcp_load(state, ckpt / MODEL_OPTIM_DIR)
    set_model_state_dict(model, state["model"])
    if lora is not None and merge:
        merge_adapters(model)
    return model, config


def export_hf(training_ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Writes the checkpoint's policy as an HF directory (config.json, model.safetensors, tokenizer);
    a LoRA policy's adapters merged into the weights."""
    model, _ = load_policy(training_ckpt_dir)
    return save_checkpoint(model, out_dir, tokenizer_dir=Path(training_ckpt_dir) / HF_CONFIG_DIR)


def export_peft_adapter(training_ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Writes a LoRA checkpoint's adapters as a PEFT adapter directory (titanrl.models.peft_adapter)."""
    ckpt = check_training_checkpoint(training_ckpt_dir)
    record = lora_record(ckpt)
    if record is None:
        raise CheckpointError(f"{str(ckpt)!r} holds no LoRA adapters (it was trained with lora.rank=0): "
                              f"export it as a full checkpoint")
    model, _ = load_policy(ckpt, merge=False)
    return save_peft_adapter(adapter_parameters(model), record, out_dir)


def load_initial_policy(checkpoint: str, dtype: torch.dtype) -> tuple[DecoderForCausalLM, DecoderConfig, str]:
    """The policy a trainer starts from: an HF checkpoint directory or a training checkpoint.

    Returns (model in `dtype`, its config, the directory holding its tokenizer files).
    """
    if is_training_checkpoint(checkpoint):
        model, config = load_policy(checkpoint)
        return model.to(dtype), config, str(Path(checkpoint) / HF_CONFIG_DIR)
    from titanrl.models.hf_checkpoint import load_model

    model, config = load_model(checkpoint, dtype=dtype)
    return model, config, checkpoint


@dataclass
class InitialPolicy:
    """Where a parallel trainer's starting weights come from, opened and checked (tensor names
    and shapes) from file headers alone: no weight is read until each rank reads its shards."""

    config: DecoderConfig
    """Architecture of the policy."""
    tokenizer_dir: str
    """Directory holding the policy's tokenizer files."""
    hf_tensors: CheckpointTensors | None = None
    """An HF checkpoint directory's tensors (None for a training checkpoint)."""
    dcp_dir: Path | None = None
    """A training checkpoint's `model_optim/` (None for an HF checkpoint directory)."""


def open_initial_policy(checkpoint: str) -> InitialPolicy:
    """`load_initial_policy` without loading: the config, and the weights' source checked against it."""
    if not is_training_checkpoint(checkpoint):
        config = read_config(checkpoint)
        return InitialPolicy(config, checkpoint, hf_tensors=checked_tensors(checkpoint, config))
    ckpt = check_training_checkpoint(checkpoint)
    config, _ = read_hf_config(ckpt)
    dcp_dir = ckpt / MODEL_OPTIM_DIR
    saved = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    found = {k.removeprefix("model."): md.size for k, md in saved.items()
             if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if config.tie_word_embeddings:  # saved beside the embedding for readers that ask for both
        found.pop(spec_for(config).state_dict_adapter.head, None)
    check_shapes(parameter_shapes(empty_meta_model(config), config), found, str(dcp_dir))
    return InitialPolicy(config, str(ckpt / HF_CONFIG_DIR), dcp_dir=dcp_dir)
