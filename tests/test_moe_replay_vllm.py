"""Router replay and the expert bias against the real generator: vLLM running our Qwen3-MoE,
recording each request's routing (titanrl.rollout.vllm.routing_record), library kernels.

Skipped where the MoE generator is absent (it lands with the vLLM MoE registration)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("titanrl.rollout.vllm.routing_record")

from moe_replay_cases import perturbed_router  # noqa: E402

from titanrl.config import ParallelConfig, TrainConfig  # noqa: E402
from titanrl.config import MemoryConfig, MoeConfig
from titanrl.models.hf_checkpoint import load_model  # noqa: E402
from titanrl.trainer.batch import pack  # noqa: E402
from titanrl.trainer.optimizer import build_optimizers  # noqa: E402
from titanrl.trainer.parallel.parallelize import parallelize  # noqa: E402
from titanrl.trainer.step import GRPOStep  # noqa: E402
from titanrl.types import Group, Sample  # noqa: E402


def _groups(engine) -> list[Group]:
    out = engine.generate(["experts: ", "12+34=", "route me"], n=3, temperature=1.0, max_tokens=12, seed=5)
    groups = []
    for gid, completions in enumerate(out):
        samples = [Sample(prompt="", completion=c.text, prompt_ids=c.prompt_token_ids, completion_ids=c.token_ids,
                          gen_logprobs=c.logprobs, reward=float(j), group_id=gid, policy_version=0,
                          routed_experts=c.routed_experts) for j, c in enumerate(completions)]
        groups.append(Group(samples))
    return groups


def _moe_stats(model, groups, replay: bool):
    cfg = TrainConfig(moe=MoeConfig(router_replay=replay, load_balance="none"), memory=MemoryConfig(micro_batch_size=4))
    pm = parallelize(model, ParallelConfig(), None)
    step = GRPOStep(pm, build_optimizers(pm, cfg), cfg, 1.0)
    return step.accumulate_gradients(pack(groups, model.config.eos_token_id or 0)).moe


def test_replay_of_the_generators_recorded_routing(vllm_moe_engine, vllm_moe_checkpoint):
    groups = _groups(vllm_moe_engine)
    model, _ = load_model(vllm_moe_checkpoint)
    same = _moe_stats(model, groups, replay=False)
    assert same.tokens_compared > 0
    assert same.route_agreement >= 0.99  # the same weights: library kernels agree (near-ties aside)
    # A trainer whose router moved since the generator sampled: replay routes it the generator's way.
    moved = perturbed_router(model, scale=0.3)
    live = _moe_stats(moved, groups, replay=False)
    replayed = _moe_stats(perturbed_router(model, scale=0.3), groups, replay=True)
    assert live.used_agreement < 0.95
    assert replayed.used_agreement == 1.0


def test_expert_bias_reaches_the_generators_routers(vllm_moe_engine, vllm_moe_checkpoint):
    """A pushed expert bias changes the generator's top-k choice as it changes the trainer's."""
    model, _ = load_model(vllm_moe_checkpoint)
    state = dict(model.state_dict())
    biases = {f"model.layers.{i}.mlp.gate.expert_bias": torch.tensor([0.0, 0.0, 0.0, 5.0])
              for i in model.config.sparse_layers}
    vllm_moe_engine.update_weights({**state, **biases}, version=1)
    try:
        groups = _groups(vllm_moe_engine)
    finally:
        zeros = {k: torch.zeros(4) for k in biases}
        vllm_moe_engine.update_weights({**state, **zeros}, version=0)
    recorded = [s.routed_experts[(s.routed_experts >= 0).all(axis=(1, 2))] for g in groups for s in g.samples]
    rows = torch.as_tensor(__import__("numpy").concatenate(recorded))
    assert len(rows) > 0 and (rows == 3).any(-1).all()  # expert 3 chosen for every token, every layer
