"""Builds the MoE example's supervised warm start: the arithmetic recipe on a small Qwen3-MoE.

    .venv/bin/python examples/moe/make_warm_start.py

Writes `warm_start/` next to this file (an HF Qwen3MoeForCausalLM checkpoint with the byte
tokenizer) and the arithmetic example's `data/` (the same task and files). The model is the
arithmetic model with every MLP replaced by 8 SwiGLU experts of width 256 routed top-2 (1.71M
parameters), trained with next-token cross-entropy on correct sums by the arithmetic
example's loop, checked every 10 steps and stopped once dev greedy accuracy reaches 30 % (the
MoE's accuracy jumps by 20 points within 100 steps here, so the dense example's 50-step checks
would overshoot a start of at most 40 %). Deterministic for a seed (single-threaded CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARITHMETIC = HERE.parent / "arithmetic"
sys.path.insert(0, str(ARITHMETIC))  # the arithmetic example's task.py and warm-start loop

import make_warm_start as arithmetic  # noqa: E402
import task  # noqa: E402

from titanrl.models.qwen3.moe import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from titanrl.models.tiny import tiny_config  # noqa: E402

MOE_FIELDS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
"""The experts: 8 per layer, top-2, each a SwiGLU of width 256: a token's two experts are as wide as the dense model's 512-wide MLP."""


def moe_config() -> Qwen3MoeConfig:
    """The arithmetic model's architecture with sparse MoE layers."""
    dense = tiny_config(**task.MODEL_CONFIG)
    return Qwen3MoeConfig(**{**vars(dense), **MOE_FIELDS})


def main() -> None:
    parser = arithmetic.build_parser(__doc__, HERE / "warm_start")
    parser.set_defaults(stop_at_dev_accuracy=0.30, check_every=10)
    args = parser.parse_args()
    model = Qwen3MoeForCausalLM(moe_config())
    model.init_weights(seed=args.seed)
    arithmetic.train_warm_start(model, args)


if __name__ == "__main__":
    main()
