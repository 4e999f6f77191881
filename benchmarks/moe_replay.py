"""How often the trainer routes a token as the generator did, with and without router replay.

    .venv/bin/python benchmarks/moe_replay.py [--out benchmarks/results/moe_replay/moe_replay.jsonl]
    .venv/bin/python benchmarks/moe_replay.py --smoke     # the same run (it is small), nothing kept

Needs the vLLM MoE generator with routing capture (rollout.engine.record_routed_experts). A tiny
Qwen3-MoE (4 experts, top-2, both layers sparse, init std 0.1) generates 3 prompts x 3 samples x
12 tokens in an in-process vLLM engine that records each token's experts; the trainer then
runs one gradient pass (`GRPOStep`, library kernels, float32) over those groups with its
weights equal to the generator's ("same_weights") and with its routers perturbed by
normal(0, scale) noise (a router that moved since the generator sampled), with and without
`train.moe.router_replay`. One JSON line per case: moe/route_agreement (the trainer's live top-k
set vs the generator's over recorded completion tokens x sparse layers), the agreement of the
experts the forward used (1.0 when replaying), moe/load_max_over_mean and moe/aux_loss.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from titanrl.config import ParallelConfig, TrainConfig  # noqa: E402
from titanrl.config import EngineConfig, MemoryConfig, MoeConfig
from titanrl.models.hf_checkpoint import load_model  # noqa: E402
from titanrl.models.qwen3.moe import Qwen3MoeConfig  # noqa: E402
from titanrl.models.tiny import tiny_config, write_checkpoint  # noqa: E402
from titanrl.trainer.batch import pack  # noqa: E402
from titanrl.trainer.optimizer import build_optimizers  # noqa: E402
from titanrl.trainer.parallel.parallelize import parallelize  # noqa: E402
from titanrl.trainer.step import GRPOStep  # noqa: E402
from titanrl.types import Group, Sample  # noqa: E402


def generate(ckpt: Path) -> list[Group]:
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(
        VllmEngineConfig(
            checkpoint=str(ckpt), settings=EngineConfig(max_model_len=512, max_num_seqs=32, record_routed_experts=True)
        )
    )
    try:
        out = engine.generate(["experts: ", "12+34=", "route me"], n=3, temperature=1.0, max_tokens=12, seed=5)
    finally:
        engine.close()
    return [Group([Sample("", c.text, c.prompt_token_ids, c.token_ids, c.logprobs, float(j), gid, 0,
                          routed_experts=c.routed_experts) for j, c in enumerate(cs)]) for gid, cs in enumerate(out)]


def perturbed(model, scale: float, seed: int = 7):
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in model.routers():
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * scale)
    return model


def moe_stats(model, groups: list[Group], replay: bool):
    cfg = TrainConfig(moe=MoeConfig(router_replay=replay), memory=MemoryConfig(micro_batch_size=4))
    pm = parallelize(model, ParallelConfig(), None)
    step = GRPOStep(pm, build_optimizers(pm, cfg), cfg, 1.0)
    return step.accumulate_gradients(pack(groups, model.config.eos_token_id or 0)).moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    parser.add_argument("--smoke", action="store_true",
                        help="a check that the script runs: the same (small) run, refusing --out")
    args = parser.parse_args()
    if args.smoke and args.out:
        parser.error("--smoke keeps no results: drop --out")
    config = Qwen3MoeConfig(**{**dataclasses.asdict(tiny_config()), "num_experts": 4, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 64})
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ckpt", config, seed=3, std=0.1)
        groups = generate(ckpt)
        model, _ = load_model(ckpt)
    cases = {"same_weights": moe_stats(copy.deepcopy(model), groups, False)}
    for scale in (0.1, 0.3):
        for replay in (False, True):
            cases[f"router_noise_{scale}{'_replay' if replay else ''}"] = moe_stats(perturbed(model, scale), groups, replay)
    lines = [json.dumps({"case": name, "route_agreement": s.route_agreement, "used_agreement": s.used_agreement,
                         "tokens_compared": s.tokens_compared, "load_max_over_mean": s.load_max_over_mean,
                         "aux_loss": s.aux_loss}) for name, s in cases.items()]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
