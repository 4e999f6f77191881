"""Data that moves between rollout workers, the buffer and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PolicyVersion = int
"""Number of optimizer steps behind a set of weights; 0 is the initial checkpoint."""


@dataclass
class RewardTerms:
    """How one sample's reward was made: the value of each reward function, unweighted."""

    values: dict[str, float] = field(default_factory=dict)
    """Reward name -> the value it returned (the sample's reward is the weighted sum); a reward
    that failed, or was not called after an earlier one failed, has no entry. Shaping terms added
    by the rollout side (`overlong_penalty`) appear here too, with their value as added."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Reward name -> wall time of its call on this sample (a batched call's time split evenly over its samples)."""
    failed: str | None = None
    """The name of the reward that failed on this sample, if one did."""


@dataclass
class Sample:
    """One completion of one prompt, with everything GRPO needs to train on it."""

    prompt: str
    """The prompt text as given to the generator."""
    completion: str
    """Decoded completion text (what the reward saw)."""
    prompt_ids: list[int]
    """Prompt token ids exactly as the generator consumed them."""
    completion_ids: list[int]
    """Generated token ids, eos included when generation stopped on it."""
    gen_logprobs: list[float]
    """Generator's log-probability of each completion token under its sampling distribution."""
    reward: float
    """Scalar reward from the reward function(s)."""
    group_id: int
    """Index of the prompt group this sample belongs to; GRPO normalizes within a group."""
    policy_version: PolicyVersion
    """Oldest version of the weights that sampled its tokens (staleness is measured by it)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The dataset row's other fields (e.g. the reference answer), passed to rewards."""
    finished: bool = True
    """False when generation hit the token limit (or an episode its budget) instead of ending."""
    loss_mask: list[int] | None = None
    """1 for tokens the model generated, 0 for environment-inserted ones; None means all 1."""
    stats: dict[str, float] = field(default_factory=dict)
    """Per-episode counters from environments (turns, tool_calls, errors, sandbox_s)."""
    reward_error: str | None = None
    """Why the reward (or the episode's environment) failed, if it did; the sample then got
    `scoring.error_value` instead of crashing the run."""
    token_versions: list[int] | None = None
    """Per completion token, the version of the weights that sampled it (observation tokens: the
    version of the model token before them). They differ only when new weights arrived while the
    sample was being generated (`rollout.continuous`); None means all `policy_version`."""
    turns: list[dict[str, str]] | None = None
    """An episode's completion turn by turn (`{"role": "model" | "env", "text": ...}`, texts joined
    equal `completion`; see `titanrl.rollout.episode.Episode.transcript`); None for single-turn."""
    routed_experts: np.ndarray | None = None
    """Mixture-of-experts policies (`rollout.engine.record_routed_experts`): the experts the generator
    routed each token of prompt + completion through, int16 [len(prompt_ids) + len(completion_ids),
    sparse layers, k]; rows of -1 were not recorded (prefix-cache hits, the last token) and are
    routed live by router replay. None: not recorded."""
    reward_terms: RewardTerms | None = None
    """Each reward function's own value, cost and failure for this sample (`reward/<name>/...`
    metrics, reward health); None where it was not scored by named rewards."""

    def __post_init__(self) -> None:
        if len(self.completion_ids) != len(self.gen_logprobs):
            raise ValueError(
                f"sample has {len(self.completion_ids)} completion tokens but {len(self.gen_logprobs)} logprobs"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.completion_ids):
            raise ValueError(
                f"sample has {len(self.completion_ids)} completion tokens but {len(self.token_versions)} token versions"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(
                f"sample has {len(self.completion_ids)} completion tokens but a loss mask of {len(self.loss_mask)}"
            )
        tokens = len(self.prompt_ids) + len(self.completion_ids)
        if self.routed_experts is not None and (self.routed_experts.ndim != 3 or len(self.routed_experts) != tokens):
            raise ValueError(f"sample has {tokens} tokens but routed_experts of shape {self.routed_experts.shape} "
                             "(expected [tokens, sparse layers, k])")

    @property
    def policy_version_max(self) -> PolicyVersion:
        """Newest version among its tokens (equals `policy_version` unless weights changed mid-sample)."""
        return max(self.token_versions, default=self.policy_version) if self.token_versions else self.policy_version


@dataclass
class Group:
    """All `group_size` completions of one prompt."""

    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def policy_version(self) -> PolicyVersion:
        """The oldest version among the samples (what staleness is measured by)."""
        return min(s.policy_version for s in self.samples)


@dataclass
class RolloutBatch:
    """What one worker returns for one generation request."""

    groups: list[Group]
    """Complete prompt groups."""
    gen_tokens: int
    """Completion tokens generated (for throughput)."""
    gen_seconds: float
    """Wall time spent generating and scoring."""
    policy_version: PolicyVersion
    """Version of the worker's weights during this request."""
    reward_seconds: float = 0.0
    """Wall time during which the request's samples were being scored (part of gen_seconds;
    for episodes, scoring overlaps the generation of the others)."""
    peak_rss_gib: float = 0.0
    """The worker process's peak resident memory so far (its vLLM engine included when in-process)."""


def group_tokens(group: Group) -> int:
    """Tokens the model generated in a group (observation tokens of episodes excluded)."""
    return sum(sum(s.loss_mask) if s.loss_mask is not None else len(s.completion_ids) for s in group.samples)


@dataclass
class StepRollouts:
    """The rollouts one training step consumes, with how they were produced."""

    groups: list[Group]
    """The step's prompt groups, in group-id order."""
    gen_tokens: int
    """Tokens the model generated in them."""
    gen_seconds: float
    """Wall time of their generation (lock-step: the slowest worker's request; continuous: since
    the previous step's rollouts were ready)."""
    reward_seconds: float | None
    """Summed wall time their requests spent scoring; None where not measured (continuous)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra per-step metrics of the rollout side (buffer, idle times, restarts, weight sync)."""
