"""Rollout groups of chosen prompt / completion lengths for the XLA tests."""

import torch

from titanrl.types import Group, Sample


def make_groups(completion_lengths: list[list[int]], seed: int = 0, prompt_len: int = 4,
                vocab: int = 256) -> list[Group]:
    """One group per inner list; sample i of a group gets completion_lengths[g][i] tokens,
    alternating rewards (so advantages are non-zero) and generator logprobs near the model's."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid, lengths in enumerate(completion_lengths):
        samples = []
        for i, n in enumerate(lengths):
            prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
            completion = torch.randint(0, vocab, (n,), generator=g).tolist()
            logprobs = (-5.5 + 0.1 * torch.rand(n, generator=g)).tolist()
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=logprobs, reward=float(i % 2), group_id=gid, policy_version=0))
        groups.append(Group(samples))
    return groups
