"""Our Qwen3 model against transformers' Qwen3ForCausalLM, and HF checkpoint round trips."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titanrl.models.hf_checkpoint import CheckpointError, load_model, read_state_dict, save_checkpoint
from titanrl.models.tiny import write_tiny_checkpoint

VARIANTS = {
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_untied_hd64": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    """Same checkpoint, same tokens: our logits equal transformers' to 1e-5 in float32."""
    from transformers import AutoModelForCausalLM

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=1, std=0.1, **VARIANTS[variant])
    ours, _ = load_model(ckpt)
    theirs = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
    tokens = torch.randint(0, ours.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(tokens).logits
        got = ours(tokens)
    assert ref.abs().max() > 0.1  # not a degenerate all-zero comparison
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_save_load_bitwise_and_transformers_loads(tmp_path):
    """A trained-then-saved policy reloads bitwise and transformers reads it unchanged."""
    from transformers import AutoModelForCausalLM

    ckpt = write_tiny_checkpoint(tmp_path / "a", seed=2, tie_word_embeddings=False)
    model, _ = load_model(ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    out = save_checkpoint(model, tmp_path / "b", tokenizer_dir=ckpt)
    again, _ = load_model(out)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert (out / "tokenizer.json").is_file()


def test_sharded_checkpoint_loads(tmp_path):
    """A sharded safetensors index loads the same tensors as the single file."""
    ckpt = write_tiny_checkpoint(tmp_path / "c", seed=3)
    state = read_state_dict(ckpt)
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(ckpt / fname))
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}})
    )
    (ckpt / "model.safetensors").unlink()
    model, _ = load_model(ckpt)
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path / "empty")


def test_corrupt_files(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "d")
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_model(ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(ckpt)


def test_shape_mismatch_and_unknown_architecture(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "e")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    with pytest.raises(CheckpointError, match=r"mlp\..*shape"):
        load_model(ckpt)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'MistralForCausalLM'"):
        load_model(ckpt)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="missing .*layers.2"):
        load_model(ckpt)


def test_tokenizer_round_trips_any_text(tmp_path):
    """The byte tokenizer is lossless on arbitrary text and puts byte b at id b."""
    from transformers import AutoTokenizer

    ckpt = write_tiny_checkpoint(tmp_path / "f")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    text = "def f(x):\n    return x + 1  # ünïcode ✓\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert tok.eos_token_id == json.loads((ckpt / "config.json").read_text())["eos_token_id"]
