"""The MoE example is complete and consistent (its full run: `titanrl train examples/moe/config.py`)."""

from pathlib import Path

from titanrl.cli import forget_shadowed_modules, load_config_file
from titanrl.config import validate
from titanrl.models.hf_checkpoint import load_model
from titanrl.models.qwen3.moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "moe"


def test_config_validates_and_replays_routing_on_the_shipped_moe_warm_start():
    """`titanrl train examples/moe/config.py` passes validation with the files in the repo, trains the
    shipped MoE warm start with router replay, and reads the arithmetic example's data."""
    forget_shadowed_modules(EXAMPLES / "arithmetic")  # another example's `task` may be cached
    config = load_config_file(str(EXAMPLE / "config.py"))
    validate(config)
    assert Path(config.model.checkpoint) == EXAMPLE / "warm_start"
    assert Path(config.data.train_file).parent == EXAMPLES / "arithmetic" / "data"
    assert config.train.moe.router_replay


def test_warm_start_is_the_small_moe_the_builder_describes():
    """The warm start is a Qwen3-MoE of 8 experts routed top-2 in both layers, 0.5-2M parameters
    (the size the example's README and make_warm_start.py state)."""
    model, config = load_model(EXAMPLE / "warm_start")
    assert isinstance(model, Qwen3MoeForCausalLM) and isinstance(config, Qwen3MoeConfig)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.sparse_layers == list(range(config.num_hidden_layers))
    assert 0.5e6 <= sum(p.numel() for p in model.parameters()) <= 2e6
