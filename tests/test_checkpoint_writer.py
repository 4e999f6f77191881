"""`python -m titanrl.models.tiny --config-json`: a published architecture with the byte tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titanrl.models.hf_checkpoint import load_model
from titanrl.models.tiny import EOS_TOKEN_ID, main
from titanrl.models.tokenizer import vocab_size_with_specials


def _hf_config(path: Path, **fields) -> Path:
    base = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "vocab_size": 1024, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
            "rope_theta": 1000000, "max_position_embeddings": 4096}
    path.write_text(json.dumps({**base, **fields}))
    return path


def test_architecture_comes_from_the_json_and_ids_from_the_tokenizer(tmp_path: Path) -> None:
    main([str(tmp_path / "ckpt"), "--config-json", str(_hf_config(tmp_path / "config.json"))])
    model, config = load_model(tmp_path / "ckpt")
    assert config.vocab_size == 1024 > vocab_size_with_specials()  # padded beyond the tokenizer
    assert (config.hidden_size, config.num_hidden_layers, config.max_position_embeddings) == (64, 1, 4096)
    assert config.eos_token_id == config.bos_token_id == EOS_TOKEN_ID
    assert model.model.embed_tokens.weight.shape == (1024, 64)


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smaller than the byte tokenizer"):
        main([str(tmp_path / "ckpt"), "--config-json", str(_hf_config(tmp_path / "c.json", vocab_size=100))])
