"""`ModelSpec`: everything generic code needs to know about one model family, in one object.

A family lives in its own folder (`titanrl/models/<family>/`): its config (the fields it reads from
config.json), its model class (the module the trainer builds and vLLM runs) and its spec. The
registry (`titanrl.models.architectures`) maps config.json's `architectures[0]` to a spec; code
outside `models/` asks the spec (or the model) and never names a family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titanrl.models.common.parallelize import DECODER_PLAN, ParallelPlan
from titanrl.models.common.state_dict_adapter import DECODER_ADAPTER, StateDictAdapter

if TYPE_CHECKING:
    from titanrl.models.common.decoder import DecoderConfig, DecoderForCausalLM

DECODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_linear_shapes(hidden: int, intermediate: int, q_width: int, kv_width: int) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of the dense decoder's block, by its name: what the
    memory plan sizes LoRA adapters and merged copies by (titanrl.planning.fit)."""
    return {"q_proj": (hidden, q_width), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width),
            "o_proj": (q_width, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}
"""Every linear of a dense decoder's attention and MLP blocks (HF's leaf names)."""


@dataclass(frozen=True)
class ModelSpec:
    """One family's entry in the registry."""

    name: str
    """Short family name, as in `titanrl models` listings and errors ("llama", "qwen3_moe")."""
    config_class: type[DecoderConfig]
    """Reads and writes the family's config.json (its `HF_ARCHITECTURE` is the registry key)."""
    model_class: type[DecoderForCausalLM]
    """The module the trainer builds and vLLM's wrapper subclasses."""
    is_moe: bool = False
    """Whether the family routes tokens to experts (expert parallelism, routing replay, aux loss)."""
    parallel_plan: ParallelPlan = field(default=DECODER_PLAN)
    """TP/SP plan of a block, compile regions, the attention core, XLA shardings."""
    state_dict_adapter: StateDictAdapter = field(default=DECODER_ADAPTER)
    """The special names of the family's state dict (embedding, head, layer prefix)."""
    tool_call_format: str = "hermes"
    """How the family's chat models write tool calls, which the agents' endpoint parses into
    `tool_calls` (`titanrl.agents.handler.TOOL_CALL_FORMATS`): 'hermes' is
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen2/2.5/3 chat
    models and of SmolLM2 among the Llama-architecture checkpoints."""
    lora_targets: tuple[str, ...] = DECODER_LORA_TARGETS
    """Leaf names of the linears low-rank adapters may wrap (lora.target_modules picks among them;
    None takes them all): the attention and MLP projections, never the embedding or the head."""

    @property
    def architecture(self) -> str:
        """config.json's `architectures[0]` for this family."""
        return self.config_class.HF_ARCHITECTURE

    @property
    def vllm_architecture(self) -> str:
        """The name our model class is registered under in vLLM's ModelRegistry (ours, so vLLM's own
        implementation of the family stays available under the HF name)."""
        return f"TitanRL{self.architecture}"
