"""Writes tiny, randomly initialised HF-format checkpoints for tests and examples.

    python -m titanrl.models.tiny OUT_DIR [--hidden-size 128 --num-hidden-layers 2 ...]
    python -m titanrl.models.tiny OUT_DIR --num-experts 4 [--num-experts-per-tok 2 --moe-intermediate-size 64]
    python -m titanrl.models.tiny OUT_DIR --config-json examples/configs/qwen3-0.6b.json

With `--config-json` the architecture is a published model's (an HF config.json) and the
tokenizer is still the byte-level one: its ids (259) are fewer than such a vocabulary, as
Qwen's own tokenizer has fewer ids than its padded 151,936-row embedding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

from titanrl.models.architectures import SPECS, build_model, config_from_hf_dict
from titanrl.models.common.decoder import DecoderConfig
from titanrl.models.hf_checkpoint import save_checkpoint
from titanrl.models.qwen3.moe import Qwen3MoeConfig
from titanrl.models.tokenizer import EOS_TOKEN, SPECIAL_TOKENS, save_byte_tokenizer, vocab_size_with_specials

EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index(EOS_TOKEN)


FAMILIES = {spec.name: spec for spec in SPECS.values() if not spec.is_moe}
"""Dense families by short name, for `tiny_config(family=...)` and `--family`."""


def tiny_config(family: str = "qwen3", **overrides) -> DecoderConfig:
    """A ~0.3M-parameter config of a dense `family` ("qwen3", "llama", "qwen2") sized for the byte
    tokenizer (head_dim 32 for vLLM's CPU attention); family fields (Llama's biases) go in overrides."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    base = dict(
        vocab_size=vocab_size_with_specials(),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=EOS_TOKEN_ID,
    )
    base.update(overrides)
    return FAMILIES[family].config_class(**base)


TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
"""The experts of `tiny_moe_config`: 4 experts, top-2, renormalised weights (as Qwen3-30B-A3B)."""


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    """`tiny_config`'s Qwen3-MoE sibling: the same attention and vocabulary, every layer sparse
    with `TINY_MOE`'s experts; any field (the experts' too) can be overridden."""
    return Qwen3MoeConfig(**{**dataclasses.asdict(tiny_config()), **TINY_MOE, **overrides})




def write_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, std: float = 0.02, **config_overrides) -> Path:
    """Writes config.json, model.safetensors and a byte-level tokenizer to `out_dir`."""
    return write_checkpoint(out_dir, tiny_config(**config_overrides), seed=seed, std=std)


def write_tiny_moe_checkpoint(out_dir: str | os.PathLike, seed: int = 0, std: float = 0.02,
                              **config_overrides) -> Path:
    """`write_tiny_checkpoint` for `tiny_moe_config(**config_overrides)`."""
    return write_checkpoint(out_dir, tiny_moe_config(**config_overrides), seed=seed, std=std)


def config_from_hf_json(path: str | os.PathLike) -> DecoderConfig:
    """A published architecture from its config.json, with the byte tokenizer's special ids."""
    config = config_from_hf_dict(json.loads(Path(path).read_text()))
    if config.vocab_size < vocab_size_with_specials():
        raise ValueError(f"{path}: vocab_size {config.vocab_size} is smaller than the byte tokenizer's "
                         f"{vocab_size_with_specials()} ids")
    return dataclasses.replace(config, eos_token_id=EOS_TOKEN_ID, bos_token_id=EOS_TOKEN_ID)


def write_checkpoint(out_dir: str | os.PathLike, config: DecoderConfig, seed: int = 0, std: float = 0.02) -> Path:
    """Writes a randomly initialised checkpoint of `config` with the byte-level tokenizer."""
    model = build_model(config)
    model.init_weights(seed=seed, std=std)
    out = save_checkpoint(model, out_dir)
    save_byte_tokenizer(out, model_max_length=config.max_position_embeddings)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    defaults = tiny_config()
    for f in dataclasses.fields(DecoderConfig):
        value = getattr(defaults, f.name)
        if isinstance(value, (bool, int, float)) and not isinstance(value, bool):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--family", default="qwen3", choices=sorted(FAMILIES), help="dense model family")
    parser.add_argument("--untied", action="store_true", help="separate LM head matrix")
    parser.add_argument("--num-experts", type=int, default=0,
                        help="write a Qwen3-MoE checkpoint with this many experts in every layer (0: dense)")
    parser.add_argument("--num-experts-per-tok", type=int, default=TINY_MOE["num_experts_per_tok"],
                        help="with --num-experts: experts each token is routed to")
    parser.add_argument("--moe-intermediate-size", type=int, default=TINY_MOE["moe_intermediate_size"],
                        help="with --num-experts: hidden width of each expert")
    parser.add_argument("--config-json", default=None,
                        help="take the architecture from this HF config.json (the other size flags are ignored)")
    args = vars(parser.parse_args(argv))
    out_dir, seed, untied, config_json = args.pop("out_dir"), args.pop("seed"), args.pop("untied"), args.pop("config_json")
    family = args.pop("family")
    moe = {name: args.pop(name) for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    if config_json:
        config = config_from_hf_json(config_json)
    elif moe["num_experts"] > 0:
        config = tiny_moe_config(tie_word_embeddings=not untied, **args, **moe)
    elif moe["num_experts"] < 0:
        parser.error(f"--num-experts must be >= 0 (0: a dense checkpoint), got {moe['num_experts']}")
    else:
        config = tiny_config(family, tie_word_embeddings=not untied, **args)
    path = write_checkpoint(out_dir, config, seed=seed)
    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(config).parameters())
    print(f"wrote {path} ({n / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
