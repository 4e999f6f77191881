"""The names generic code needs of a decoder's state dict, in one place.

Parameters keep Hugging Face's names, so loading and saving need no renaming; what trainers,
weight pushes and checkpoints still need to know is which names are special: the embedding and
the LM head (tied or not), the per-layer prefix, and buffers some HF files carry that the model
recomputes. A family whose names differ gives its spec another adapter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateDictAdapter:
    """Special parameter names of a family's HF state dict."""

    embed: str = "model.embed_tokens.weight"
    """The input embedding; with tied embeddings also the name the shared matrix is saved, published
    and counted under."""
    head: str = "lm_head.weight"
    """The LM head; absent from HF files of a tied model."""
    embed_prefix: str = "model.embed_tokens."
    """Prefix of every tensor of the embedding module (owned by the first pipeline stage)."""
    layers_prefix: str = "model.layers."
    """Prefix of the decoder layers' tensors, followed by the layer index."""
    recomputed_buffers: tuple[str, ...] = ("rotary_emb.inv_freq",)
    """Suffixes of tensors some HF checkpoints carry that the model recomputes (skipped on load)."""

    def layer_index(self, name: str) -> int | None:
        """The decoder layer a tensor belongs to, None for embedding, final norm and head."""
        if not name.startswith(self.layers_prefix):
            return None
        return int(name[len(self.layers_prefix):].split(".", 1)[0])

    def is_embedding(self, name: str) -> bool:
        """Whether the tensor belongs to the input embedding module."""
        return name.startswith(self.embed_prefix)

    def decays(self, name: str, tied: bool) -> bool:
        """Whether AdamW's weight decay applies to parameter `name`: not to norms' gains, biases or
        the embedding (nor, with tied embeddings, the head, which is the embedding)."""
        if name.endswith("norm.weight") or name.endswith(".bias") or name == self.embed:
            return False
        return not (tied and name == self.head)

    def is_recomputed(self, name: str) -> bool:
        """Whether the tensor is a buffer the model recomputes (never loaded or pushed)."""
        return name.endswith(self.recomputed_buffers)


DECODER_ADAPTER = StateDictAdapter()
"""The adapter of every family built on `titanrl.models.common.decoder` (HF Llama-style names)."""
