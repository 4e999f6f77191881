"""Hugging Face checkpoint directories: config.json + safetensors (+ tokenizer files).

Our parameter names are HF's, so the state-dict adapter only has to deal with the
tied LM head (HF files omit `lm_head.weight` when embeddings are tied) and with
sharded checkpoints (`model.safetensors.index.json`). Weights are read through one
reader, `CheckpointTensors.read_into`: whole tensors in one process, each rank's blocks
in a parallel layout (trainer/parallel/sharded_load.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from titanrl.atomic_io import replacing_directory
from titanrl.models.architectures import build_model, config_from_hf_dict
from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM
from titanrl.models.common.state_dict_adapter import DECODER_ADAPTER
from titanrl.models.qwen3.moe import (
    expert_checkpoint_name,
    parse_expert_checkpoint_name,
    stacked_expert_name,
    zero_routing_buffers,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
EMBED = DECODER_ADAPTER.embed
HEAD = DECODER_ADAPTER.head


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt or does not fit the model."""


def read_config(ckpt_dir: str | os.PathLike) -> DecoderConfig:
    """Parses `config.json` of an HF checkpoint directory into its architecture's config."""
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
        return config_from_hf_dict(hf)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{str(cfg_file)!r}: {e}") from e


def weight_files(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a single-file or sharded (index) checkpoint, checked to exist."""
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
    for name in shard_names:
        if not (path / name).is_file():
            raise CheckpointError(f"shard {str(path / name)!r} listed in {INDEX_FILE} is missing")
    return [path / name for name in shard_names]


def read_state_dict(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads all tensors of a single-file or sharded safetensors checkpoint."""
    state: dict[str, torch.Tensor] = {}
    for shard in weight_files(ckpt_dir):
        try:
            state.update(load_file(str(shard)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{str(shard)!r} is not a readable safetensors file ({e})") from e
    return state


def checkpoint_name(name: str, config: DecoderConfig) -> str:
    """The checkpoint tensor a parameter loads from: a tied LM head (or a pipeline stage's copy of
    it) from the embedding, which is all an HF file of a tied model is sure to hold."""
    return EMBED if config.tie_word_embeddings and name == HEAD else name


def parameter_shapes(model: nn.Module, config: DecoderConfig) -> dict[str, torch.Size]:
    """The model's own tensor names and full shapes (what a training checkpoint stores), without a
    tied head."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop(HEAD, None)
    return shapes


def expected_shapes(model: nn.Module, config: DecoderConfig) -> dict[str, torch.Size]:
    """HF checkpoint tensor names and full shapes that `model` (whole, on any device, meta too)
    loads: its parameters, with stacked experts as one tensor per expert."""
    shapes: dict[str, torch.Size] = {}
    for name, shape in parameter_shapes(model, config).items():
        if stacked_expert_name(name) is None:
            shapes[name] = shape
        else:
            shapes.update({expert_checkpoint_name(name, e): shape[1:] for e in range(shape[0])})
    return shapes


def to_checkpoint_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model-named tensors as an HF checkpoint names them: a stacked expert tensor becomes one
    tensor per expert (views, no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if stacked_expert_name(name) is None:
            out[name] = tensor
        else:
            out.update({expert_checkpoint_name(name, e): tensor[e] for e in range(tensor.shape[0])})
    return out


def from_checkpoint_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_checkpoint_tensors`: per-expert tensors stacked into the model's names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        parsed = parse_expert_checkpoint_name(name)
        if parsed is None:
            out[name] = tensor
        else:
            experts.setdefault(parsed[0], {})[parsed[1]] = tensor
    for name, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise CheckpointError(f"experts of {name!r} are not numbered 0..{len(by_expert) - 1}: {sorted(by_expert)}")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def read_parameter(tensors: CheckpointTensors, name: str, config: DecoderConfig, out: torch.Tensor,
                   offset: Sequence[int] | None = None) -> None:
    """Fills `out` with the block of model parameter `name` at `offset` from an HF checkpoint:
    one tensor, or for stacked experts one tensor per expert row of the block."""
    offset = tuple(offset) if offset is not None else (0,) * out.dim()
    if stacked_expert_name(name) is None:
        tensors.read_into(checkpoint_name(name, config), out, offset)
        return
    for i in range(out.shape[0]):
        tensors.read_into(expert_checkpoint_name(name, offset[0] + i), out[i], offset[1:])


def check_shapes(expected: dict[str, torch.Size], found: dict[str, torch.Size], source: str) -> None:
    """A CheckpointError naming missing / unexpected tensors, or the first one of the wrong shape."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the model config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, shape in found.items():
        if shape != expected[name]:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(shape)} but config.json implies {tuple(expected[name])}"
            )


class CheckpointTensors:
    """The tensors of an HF checkpoint directory as its safetensors headers describe them (which
    file holds each, and its shape), read without touching any data; `read_into` then copies one
    tensor, or one block of it, into a target. The one reader of weights: the single-process
    load reads whole tensors, a sharded rank only its blocks (trainer/parallel/sharded_load.py).
    """

    READ_BLOCK_BYTES = 16 << 20
    """Most bytes of the file one read maps: each block gets its own mapping, released after the
    copy, so a reader's resident file pages stay one block, not the tensors it has read."""

    def __init__(self, ckpt_dir: str | os.PathLike) -> None:
        self.source = str(ckpt_dir)
        self.files: dict[str, Path] = {}
        """Tensor name -> the safetensors file holding it."""
        self.shapes: dict[str, torch.Size] = {}
        """Tensor name -> its full shape."""
        for shard in weight_files(ckpt_dir):
            try:
                with safe_open(str(shard), framework="pt") as f:
                    for name in f.keys():
                        self.files[name] = shard
                        self.shapes[name] = torch.Size(f.get_slice(name).get_shape())
            except (SafetensorError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{str(shard)!r} is not a readable safetensors file ({e})") from e

    def check(self, expected: dict[str, torch.Size]) -> None:
        """Names and shapes against what a model loads (`expected_shapes`), before any data is read.

        A tied model's checkpoint may also hold `lm_head.weight`: it is not read (see checkpoint_name).
        """
        found = dict(self.shapes)
        if HEAD not in expected and EMBED in expected:
            found.pop(HEAD, None)
        check_shapes(expected, found, self.source)

    def read_into(self, name: str, out: torch.Tensor, offset: Sequence[int] | None = None) -> None:
        """Copies the block of tensor `name` that starts at `offset` (default: 0s) and has
        `out`'s shape into `out`, cast to `out`'s dtype. Touches only the file rows the block spans
        (a block of columns still reads whole pages of those rows)."""
        offset = tuple(offset) if offset is not None else (0,) * out.dim()
        full = self.shapes[name]
        if len(offset) != len(full) or out.dim() != len(full) or any(
            o < 0 or o + n > f for o, n, f in zip(offset, out.shape, full, strict=True)
        ):
            raise CheckpointError(
                f"{self.source}: block {tuple(out.shape)} at {offset} does not fit {name} of shape {tuple(full)}"
            )
        if out.numel() == 0:
            return
        if out.dim() == 0:
            with safe_open(str(self.files[name]), framework="pt") as f:
                out.copy_(f.get_tensor(name))
            return
        index = [slice(o, o + n) for o, n in zip(offset, out.shape, strict=True)]
        # Blocks over the first dimension, sized by the full rows they touch (in out's element size).
        row_bytes = max(1, math.prod(full[1:]) * out.element_size())
        rows = max(1, self.READ_BLOCK_BYTES // row_bytes)
        for lo in range(0, out.shape[0], rows):
            hi = min(out.shape[0], lo + rows)
            with safe_open(str(self.files[name]), framework="pt") as f:
                out[lo:hi].copy_(f.get_slice(name)[(slice(offset[0] + lo, offset[0] + hi), *index[1:])])


def load_state_dict_into(model: DecoderForCausalLM, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Copies tensors into `model`, checking names and shapes first: HF-named ones (experts one
    tensor each) or model-named ones (stacked experts, as the trainer gathers them)."""
    params = model.state_dict()  # tensors share storage with the parameters
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != HEAD}
    state = from_checkpoint_tensors(state)
    check_shapes(parameter_shapes(model, model.config), {k: v.shape for k, v in state.items()}, source)
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def tie_head(model: nn.Module) -> None:
    """Makes a tied model's LM head the embedding's Parameter again where both are present
    (`to_empty` gives each module its own; a pipeline stage holds at most one of them)."""
    head, embed = getattr(model, "lm_head", None), getattr(model.model, "embed_tokens", None)
    if model.config.tie_word_embeddings and head is not None and embed is not None and head.weight is not embed.weight:
        head.weight = embed.weight


def empty_meta_model(config: DecoderConfig, dtype: torch.dtype = torch.float32) -> DecoderForCausalLM:
    """A model of `config` on the meta device: shapes, names and dtype, no storage."""
    with torch.device("meta"):
        return build_model(config).to(dtype)


def empty_model(config: DecoderConfig, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DecoderForCausalLM:
    """An uninitialised model of `config` in `dtype` on `device` (weights are loaded next)."""
    model = empty_meta_model(config, dtype).to_empty(device=device)
    tie_head(model)
    zero_routing_buffers(model)  # the only buffers, which to_empty leaves uninitialised
    return model


def checked_tensors(ckpt_dir: str | os.PathLike, config: DecoderConfig) -> CheckpointTensors:
    """An HF checkpoint directory's tensors, their names and shapes checked against `config` from
    the file headers alone (no weight is read): a CheckpointError names the first mismatch."""
    tensors = CheckpointTensors(ckpt_dir)
    tensors.check(expected_shapes(empty_meta_model(config), config))
    return tensors


def load_model(
    ckpt_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[DecoderForCausalLM, DecoderConfig]:
    """Builds our model from an HF checkpoint directory, one tensor at a time (cast to `dtype`)."""
    config = read_config(ckpt_dir)
    tensors = CheckpointTensors(ckpt_dir)
    model = empty_model(config, dtype, device)
    tensors.check(expected_shapes(model, config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            read_parameter(tensors, name, config, param)
    return model, config


def hf_state_dict(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint holds: contiguous, detached, no duplicate tied head, one tensor
    per expert."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop(HEAD, None)
    return {k: v.detach().contiguous() for k, v in to_checkpoint_tensors(state).items()}


def save_checkpoint(
    model: DecoderForCausalLM, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None
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
