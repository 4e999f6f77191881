"""A tiny mixture-of-experts policy and rollout groups whose `routed_experts` come from a second
model (the policy with a perturbed router) standing in for the generator. Shared by
tests/test_moe_replay.py and the spawned worlds of tests/moe_replay_worlds.py."""

from __future__ import annotations

import copy

import numpy as np
import torch

from titanrl.models.qwen3.moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from titanrl.types import Group, Sample

EOS = 1


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  eos_token_id=EOS, tie_word_embeddings=False)
    return Qwen3MoeConfig(**{**fields, **overrides})


def tiny_moe_model(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    model = Qwen3MoeForCausalLM(tiny_moe_config(**overrides))
    model.init_weights(seed=seed, std=0.2)
    return model


def perturbed_router(model: Qwen3MoeForCausalLM, scale: float = 0.1, seed: int = 7) -> Qwen3MoeForCausalLM:
    """A copy of `model` whose routers' weights carry noise: a generator that routes some tokens differently."""
    gen_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in gen_model.routers():
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * scale)
    return gen_model


@torch.no_grad()
def record_routing(gen_model: Qwen3MoeForCausalLM, seq: list[int]) -> np.ndarray:
    """The experts `gen_model` routes each token of `seq` through: int16 [len(seq), layers, k]."""
    layers = gen_model.config.sparse_layers
    seen: dict[int, torch.Tensor] = {}
    for router in gen_model.routers():
        router.capture = lambda layer, experts: seen.__setitem__(layer, experts.clone())
    gen_model(torch.tensor([seq]))
    for router in gen_model.routers():
        router.capture = None
    return torch.stack([seen[i] for i in layers], 1).numpy().astype(np.int16)


def groups_with_routing(gen_model: Qwen3MoeForCausalLM | None, num_groups: int = 2, group_size: int = 3,
                        seed: int = 0, unrecorded_prompt_tokens: int = 2) -> list[Group]:
    """Random prompts and completions of varied lengths, with rewards that differ within a group;
    each sample's routing recorded by `gen_model` (None: no routing), its first
    `unrecorded_prompt_tokens` rows -1 (as a prefix-cache hit leaves them)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(num_groups):
        samples = []
        for j in range(group_size):
            p = int(torch.randint(3, 7, (1,), generator=g))
            c = int(torch.randint(3, 9, (1,), generator=g))
            prompt = torch.randint(2, 64, (p,), generator=g).tolist()
            completion = torch.randint(2, 64, (c,), generator=g).tolist()
            routed = None
            if gen_model is not None:
                routed = record_routing(gen_model, prompt + completion)
                routed[:unrecorded_prompt_tokens] = -1
            logprobs = (-torch.rand(c, generator=g) * 3).tolist()
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=logprobs, reward=float(j + gid), group_id=gid, policy_version=0,
                                  routed_experts=routed))
        groups.append(Group(samples))
    return groups
