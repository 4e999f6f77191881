"""A LoRA policy's adapters as a PEFT adapter directory, which `peft` loads onto the base model.

The directory holds `adapter_config.json` (rank, alpha, target modules, the base checkpoint) and
`adapter_model.safetensors`, whose keys are the adapters' parameter names under PEFT's prefix:
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` for our
`model.layers.0.self_attn.q_proj.lora_A.weight` (our module names are Hugging Face's, so the
rest of the name is PEFT's already).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from titanrl.atomic_io import replacing_directory
from titanrl.models.common.lora import LoraRecord

PEFT_PREFIX = "base_model.model."
"""What PEFT's saved keys put before the wrapped model's own parameter names."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
EXPORT_ADAPTER_DIR = "adapter"
"""Where a LoRA run's HF export (`final/`, the merged weights) keeps the adapters in PEFT's format."""


def adapter_config(record: LoraRecord) -> dict:
    """adapter_config.json for PEFT's LoraConfig (no dropout, no bias training, plain scaling)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": record.base_model,
        "r": record.rank,
        "lora_alpha": record.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(record.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapter(adapters: Mapping[str, torch.Tensor], record: LoraRecord, out_dir: str | os.PathLike) -> Path:
    """Writes the adapter factors `adapters` (whole tensors by parameter name, `...q_proj.lora_A.weight`:
    `adapter_parameters(model)` of a model with `LoraLinear`s) as a PEFT adapter directory, atomically."""
    if not adapters:
        raise ValueError("the model has no LoRA adapters to save")
    tensors = {PEFT_PREFIX + name: p.detach().contiguous().cpu() for name, p in adapters.items()}
    out = Path(out_dir)
    with replacing_directory(out) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(record), indent=2) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out
