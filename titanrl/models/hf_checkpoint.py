"""Hugging Face checkpoint directories: config.json + safetensors (+ tokenizer files).

Our parameter names are HF's, so the state-dict adapter only has to deal with the
tied LM head (HF files omit `lm_head.weight` when embeddings are tied) and with
sharded checkpoints (`model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from titanrl.atomic_io import replacing_directory
from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt or does not fit the model."""


def read_config(ckpt_dir: str | os.PathLike) -> Qwen3Config:
    """Parses `config.json` of an HF checkpoint directory into a Qwen3Config."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(cfg_file)!r} is missing: an HF checkpoint directory needs a config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(cfg_file)!r} is not valid JSON ({e})") from e
    try:
        return Qwen3Config.from_hf_dict(hf)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{str(cfg_file)!r}: {e}") from e


def read_state_dict(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads all tensors of a single-file or sharded safetensors checkpoint."""
    path = Path(ckpt_dir)
    if (path / INDEX_FILE).is_file():
        try:
            weight_map: dict[str, str] = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{str(path / INDEX_FILE)!r} is not a valid safetensors index ({e})") from e
        shard_names = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        shard_names = [SINGLE_FILE]
    else:
        raise CheckpointError(
            f"no weights in {str(path)!r}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards"
        )
    state: dict[str, torch.Tensor] = {}
    for name in shard_names:
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"shard {str(shard)!r} listed in {INDEX_FILE} is missing")
        try:
            state.update(load_file(str(shard)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{str(shard)!r} is not a readable safetensors file ({e})") from e
    return state


def load_state_dict_into(model: Qwen3ForCausalLM, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Copies HF-named tensors into `model`, checking names and shapes first."""
    expected = model.state_dict()  # tensors share storage with the parameters
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the model config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(expected[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in state.items():
            expected[name].copy_(tensor)


def load_model(
    ckpt_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Qwen3ForCausalLM, Qwen3Config]:
    """Builds our model from an HF checkpoint directory."""
    config = read_config(ckpt_dir)
    state = read_state_dict(ckpt_dir)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    load_state_dict_into(model, state, source=str(ckpt_dir))
    return model.to(dtype), config


def hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint holds: contiguous, detached, no duplicate tied head."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(
    model: Qwen3ForCausalLM, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None
) -> Path:
    """Writes an HF checkpoint directory atomically (a crash leaves the old one intact).

    Tokenizer files are copied from `tokenizer_dir` so the result is self-contained.
    """
    out = Path(out_dir)
    with replacing_directory(out) as tmp:
        cfg = model.config.to_hf_dict()
        cfg["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(hf_state_dict(model), str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
    return out
