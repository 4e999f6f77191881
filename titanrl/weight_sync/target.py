"""The receiving end inside the engine: a model's parameters, checked against a layout, then written.

Runs where the vLLM model lives (the RolloutWorker's process for the in-process engine, the
engine-core process for the multiprocess one). The whole layout is checked before the first
byte is written, so a wrong announcement never leaves the engine half-loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from titanrl.models.architectures import spec_for
from titanrl.models.common.lora import adapter_parameters
from titanrl.models.common.state_dict_adapter import DECODER_ADAPTER
from titanrl.models.qwen3.moe import routing_buffers
from titanrl.weight_sync.layout import TensorSpec, WeightLayout, WeightSyncError



class ParameterTarget:
    """A model's parameters by HF name, as the destination of a weight transfer."""

    def __init__(self, model: nn.Module) -> None:
        # A tied LM head appears once, as the embedding. A model with low-rank adapters (lora.sync=
        # 'adapter') takes its adapters alone: the base is frozen, and writing merged weights into
        # it would apply the adapters twice.
        self.params = adapter_parameters(model) or dict(model.named_parameters())
        # Router expert biases (mixture of experts): written when announced, never required.
        self.optional = routing_buffers(model)
        config = getattr(model, "config", None)  # None: a bare module (tests), no tied head
        self.tied = bool(config is not None and config.tie_word_embeddings)
        self.adapter = spec_for(config).state_dict_adapter if config is not None else DECODER_ADAPTER

    def check(self, layout: WeightLayout, allow_partial: bool = False) -> list[torch.Tensor | None]:
        """For each tensor of `layout`, the parameter data it goes into (None: not loaded here,
        e.g. a tied LM head). Raises WeightSyncError naming what does not fit, before any write."""
        dests: list[torch.Tensor | None] = []
        problems: list[str] = []
        for spec in layout.tensors:
            dests.append(self._dest(spec, problems))
        missing = set(self.params) - {s.name for s in layout.tensors}
        if missing and not allow_partial:
            problems.append(f"{len(missing)} parameter(s) missing, e.g. {sorted(missing)[:3]}")
        if problems:
            raise WeightSyncError(
                f"the announced weights ({layout.describe()}) do not fit this engine's model "
                f"({len(self.params)} parameters): {'; '.join(problems[:4])}"
                f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}. Publish from a "
                "trainer of the same model (model.checkpoint) as the rollout workers"
            )
        return dests

    def _dest(self, spec: TensorSpec, problems: list[str]) -> torch.Tensor | None:
        # A tied head is the embedding; buffers some HF files carry are recomputed by the model.
        if (spec.name == self.adapter.head and self.tied) or self.adapter.is_recomputed(spec.name):
            return None
        param = self.params.get(spec.name, self.optional.get(spec.name))
        if param is None:
            problems.append(f"{spec.name!r} matches no parameter")
            return None
        if tuple(param.shape) != spec.shape:
            problems.append(f"{spec.name!r} has shape {spec.shape}, the engine's is {tuple(param.shape)}")
            return None
        if not param.is_contiguous():
            problems.append(f"the engine's {spec.name!r} is not contiguous (cannot be written in place)")
            return None
        return param.data

    def tensors(self) -> list[torch.Tensor]:
        """Every Parameter (and optional buffer) a layout may write, as the tensors themselves."""
        return [*self.params.values(), *self.optional.values()]

    def tensor(self, name: str) -> torch.Tensor:
        """The Parameter (or optional buffer) `name` itself."""
        return self.params[name] if name in self.params else self.optional[name]

    def adopt(self, name: str, view: torch.Tensor) -> None:
        """Makes `view` (checked: same shape and dtype) the data of parameter `name`, no copy."""
        self.tensor(name).data = view


def write_piece(dest: torch.Tensor, first: int, src: torch.Tensor) -> None:
    """Copies the flat `src` into elements [first, first + numel) of `dest` (casting if dtypes differ)."""
    with torch.no_grad():
        dest.view(-1)[first : first + src.numel()].copy_(src)
