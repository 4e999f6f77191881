"""Writes tiny, randomly initialised HF-format checkpoints for tests and examples.

    python -m titanrl.models.tiny OUT_DIR [--hidden-size 128 --num-hidden-layers 2 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path


from titanrl.models.hf_checkpoint import save_checkpoint
from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from titanrl.models.tokenizer import EOS_TOKEN, SPECIAL_TOKENS, save_byte_tokenizer, vocab_size_with_specials

EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index(EOS_TOKEN)


def tiny_config(**overrides) -> Qwen3Config:
    """A ~0.3M-parameter Qwen3 config sized for the byte tokenizer (head_dim 32 for vLLM's CPU attention)."""
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
    return Qwen3Config(**base)


def write_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, std: float = 0.02, **config_overrides) -> Path:
    """Writes config.json, model.safetensors and a byte-level tokenizer to `out_dir`."""
    config = tiny_config(**config_overrides)
    model = Qwen3ForCausalLM(config)
    model.init_weights(seed=seed, std=std)
    out = save_checkpoint(model, out_dir)
    save_byte_tokenizer(out, model_max_length=config.max_position_embeddings)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    defaults = tiny_config()
    for f in dataclasses.fields(Qwen3Config):
        value = getattr(defaults, f.name)
        if isinstance(value, (bool, int, float)) and not isinstance(value, bool):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--untied", action="store_true", help="separate LM head matrix")
    args = vars(parser.parse_args(argv))
    out_dir, seed, untied = args.pop("out_dir"), args.pop("seed"), args.pop("untied")
    path = write_tiny_checkpoint(out_dir, seed=seed, tie_word_embeddings=not untied, **args)
    n = sum(p.numel() for p in Qwen3ForCausalLM(tiny_config(**args)).parameters())
    print(f"wrote {path} ({n / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
