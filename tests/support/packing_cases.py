"""A GRPO batch with rows of very different lengths, and one trainer accumulation on it: the cases
the packing tests (and the compile, oneDNN, CUDA and idle-core tests) compare gradients on."""

from __future__ import annotations

import random

import numpy as np
import torch

from support.sections import merged
from titanrl.config import ComputeConfig, MemoryConfig, ModelConfig, TrainConfig
from titanrl.models.tiny import TINY_MOE
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample


def varied_groups(seed: int = 0, routed_layers: int = 0) -> list[Group]:
    """Groups whose prompts and completions differ in length (rows of very different padding),
    with env-inserted (loss-mask 0) tokens in some completions."""
    rng = random.Random(seed)
    out = []
    for g in range(3):
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 9))]
        samples = []
        for _ in range(4):
            n = rng.randint(1, 14)
            completion = [rng.randrange(256) for _ in range(n)]
            mask = [float(rng.random() > 0.2) for _ in range(n)] if rng.random() < 0.5 else None
            routed = None
            if routed_layers:
                k, e = TINY_MOE["num_experts_per_tok"], TINY_MOE["num_experts"]
                routed = np.stack([np.random.default_rng(seed + g).permutation(e)[:k]
                                   for _ in range((len(prompt) + n) * routed_layers)]).reshape(-1, routed_layers, k)
                routed = routed.astype("int16")
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=[-rng.uniform(3, 8) for _ in range(n)], reward=rng.random(),
                                  group_id=g, policy_version=0, loss_mask=mask, routed_experts=routed))
        out.append(Group(samples))
    return out


def accumulated_gradients(checkpoint, groups, pack: bool, batch_invariant: bool = False, share: bool = True,
               device: str = "cpu", dtype: str = "float32", **train):
    """One accumulation on `device`: gradients (on the CPU), stats, logprobs, tokens computed, batch."""
    train_config = merged(TrainConfig(compute=ComputeConfig(device=device, pack_sequences=pack, share_prompts=share),
                                      memory=MemoryConfig(micro_batch_size=5)), **train)
    setup = TrainerSetup(ModelConfig(checkpoint=str(checkpoint), dtype=dtype), train_config, temperature=1.0, seed=0,
                         batch_invariant=batch_invariant)
    trainer = GRPOTrainer(setup)
    tokens = []
    hook = trainer.model.model.embed_tokens.register_forward_hook(lambda m, i, o: tokens.append(i[0].numel()))
    batch = trainer.prepare_batch(groups)
    stats = trainer.accumulate_gradients(batch)
    hook.remove()
    grads = {n: p.grad.float().cpu() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return grads, stats, trainer.grpo.batch_logprobs(batch).float().cpu(), sum(tokens), batch


def assert_same_gradients(a: dict, b: dict, atol: float = 1e-7) -> None:
    """Same parameter names (at least one) and gradients within rtol 1e-4 and `atol`."""
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)
