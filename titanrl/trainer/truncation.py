"""The generator's truncated sampling distribution (top-k, then top-p), decided as vLLM decides it.

With `rollout.sampling.top_k > 0` or `rollout.sampling.top_p < 1` vLLM samples from softmax(z) renormalised over a
kept set of tokens, z = logits / temperature in float32, and (logprobs_mode='processed_logprobs')
reports log p_trunc(y) = z_y - logsumexp(z over the kept set). The trainer scores the same
quantity on its own logits, so at equal weights the PPO ratio is 1, not the nucleus mass Z < 1.

`kept_mask` is op for op the PyTorch path of vLLM 0.32's sampler (`apply_top_k_top_p_pytorch`
and `apply_top_k_only` in vllm/v1/sample/ops/topk_topp_sampler.py), the one vLLM's CPU build
runs (its Triton path needs a Triton CPU backend the CPU wheel does not ship):
- top-k alone: keep z >= the k-th largest value (ties with it are all kept, so possibly > k
  tokens), no sort;
- top-p (after top-k when both are set): sort ascending (torch's default, unstable sort: ties
  are ordered as vLLM's identical call orders them), softmax of the sorted row in float32
  (top-k's dropped tokens at -inf), cumulative sum, drop where it is <= 1 - top_p (1 - top_p
  computed in float32, as vLLM's float32 `top_p` tensor), never the last (largest) token: at
  least one token stays.
Every op works on one row, and on CPU each gives a row the same bits whatever rows share the
call (sort, softmax, cumsum: tests/test_truncated_logprobs.py), so with batch-invariant logits the
kept set is bitwise vLLM's. vLLM on CUDA decides the set with other kernels (Triton's
pivot-based top-k/top-p, FlashInfer), which this does not reproduce at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from titanrl.config.schema import RolloutConfig


@dataclass(frozen=True)
class Truncation:
    """Top-k / top-p truncation of the sampling distribution the trainer scores tokens under."""

    top_k: int = 0
    """Keep the k most likely tokens (ties with the k-th included); 0: off (as vLLM's 0)."""
    top_p: float = 1.0
    """Then keep the smallest most-likely set of mass > top_p (vLLM's rule); 1.0: off."""

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"Truncation.top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Truncation.top_p must be in (0, 1], got {self.top_p}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

    @classmethod
    def scored_by_trainer(cls, rollout: RolloutConfig) -> Truncation | None:
        """What the trainer must truncate for `rollout`: None when nothing is truncated or when
        `rollout.sampling.logprobs='raw'` (both sides then score the full softmax)."""
        truncation = cls(rollout.sampling.top_k, rollout.sampling.top_p)
        return truncation if truncation.active and rollout.sampling.logprobs == "sampled" else None


@torch.no_grad()
def kept_mask(z_NV: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """bool [N, V]: the tokens vLLM's sampler keeps for each row of scaled float32 logits z."""
    V = z_NV.shape[-1]
    use_k = 0 < truncation.top_k < V  # vLLM treats top_k >= vocabulary as off
    if truncation.top_p >= 1:
        if not use_k:
            return torch.ones_like(z_NV, dtype=torch.bool)
        kth = z_NV.topk(truncation.top_k, dim=-1).values[:, -1:]
        return ~(z_NV < kth)
    z_sort, order = z_NV.sort(dim=-1, descending=False)
    dropped = torch.zeros_like(z_sort, dtype=torch.bool)
    if use_k:
        dropped = z_sort < z_sort[:, V - truncation.top_k:V - truncation.top_k + 1]
        z_sort.masked_fill_(dropped, float("-inf"))
    probs = z_sort.softmax(dim=-1)
    cumulative = torch.cumsum(probs, dim=-1, out=probs)
    top_p = torch.full((1,), truncation.top_p, dtype=torch.float32, device=z_NV.device)
    drop_p = cumulative <= 1 - top_p
    drop_p[:, -1] = False  # at least one token
    return torch.empty_like(dropped).scatter_(-1, order, ~(dropped | drop_p))
