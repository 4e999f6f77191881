"""The single-turn path shared by every worker: rows -> prompts -> completions -> rewards -> Samples.

Lock-step (`RolloutWorker.generate` / `evaluate`, on the blocking engine) and continuous
(`ContinuousRolloutWorker`, on the async generator) differ only in how they ask the engine for
completions; what a completion is scored with, how a scored completion becomes a `Sample`, and
how greedy completions become an evaluation summary are written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titanrl.rewards.batch_scoring import ToScore
from titanrl.rewards.length import linear_overlong_penalty
from titanrl.rewards.scoring import eval_summary, row_fields
from titanrl.types import Group, RewardTerms, Sample

if TYPE_CHECKING:
    from titanrl.config import RolloutConfig
    from titanrl.rollout.vllm.engine import Completion

Scored = tuple[float, str | None] | tuple[float, str | None, RewardTerms]
"""A completion's (reward, error[, terms]): error is None, or why the reward failed (reward is then
error_value); `terms` as `RewardScorer.score_results` gives them."""

OVERLONG_TERM = "overlong_penalty"
"""The name of the soft overlong penalty among a sample's reward terms (`reward/overlong_penalty/mean`)."""


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong penalty on training completions (`rollout.shaping.overlong_buffer`)."""

    max_tokens: int
    """rollout.sampling.max_new_tokens."""
    buffer: int
    """rollout.shaping.overlong_buffer (>= 1)."""
    scale: float
    """rollout.shaping.overlong_penalty."""

    def __call__(self, num_tokens: int) -> float:
        return self.scale * linear_overlong_penalty(num_tokens, self.max_tokens, self.buffer)

    @classmethod
    def of(cls, rc: RolloutConfig) -> OverlongPenalty | None:
        """The penalty `rc` asks for, None when rollout.shaping.overlong_buffer is 0."""
        return (
            cls(rc.sampling.max_new_tokens, rc.shaping.overlong_buffer, rc.shaping.overlong_penalty)
            if rc.shaping.overlong_buffer > 0
            else None
        )


@dataclass(frozen=True)
class SingleTurn:
    """How a worker turns dataset rows into prompts and scored single-turn completions into Samples."""

    prompt_field: str
    """The row key holding the prompt (data.prompt_field); the other keys go to the rewards."""
    stop_token_ids: list[int] | None
    """Tokens that end a completion (the model's eos), None when the model has none."""
    overlong: OverlongPenalty | None = None
    """Added to the reward of every training sample that `groups` makes (not to evaluation's)."""

    def prompt(self, row: dict[str, Any]) -> str:
        return row[self.prompt_field]

    def sampling(self, rc: RolloutConfig) -> dict[str, Any]:
        """Training-time sampling arguments (engine.generate and AsyncGenerator.generate take both)."""
        return dict(
            temperature=rc.sampling.temperature,
            top_p=rc.sampling.top_p,
            top_k=rc.sampling.top_k,
            max_tokens=rc.sampling.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
        )

    def greedy(self, max_tokens: int) -> dict[str, Any]:
        """Evaluation's sampling arguments: greedy, `max_tokens` at most."""
        return dict(temperature=0.0, max_tokens=max_tokens, stop_token_ids=self.stop_token_ids)

    def to_score(self, rows: list[dict[str, Any]], outputs: list[list[Completion]]) -> list[ToScore]:
        """What the reward functions are called with, for every completion of every row, in row order."""
        return [ToScore(self.prompt(row), c.text, row_fields(row, self.prompt_field))
                for row, completions in zip(rows, outputs, strict=True) for c in completions]

    def groups(self, rows: list[dict[str, Any]], outputs: list[list[Completion]], scored: list[Scored],
               first_group_id: int) -> list[Group]:
        """One Group per row of its scored completions; `scored` is in `to_score`'s order."""
        flat = iter(scored)
        return [Group([self.sample(row, c, next(flat), first_group_id + j) for c in completions])
                for j, (row, completions) in enumerate(zip(rows, outputs, strict=True))]

    def sample(self, row: dict[str, Any], c: Completion, scored: Scored, group_id: int) -> Sample:
        """A scored single-turn completion as a training sample (with the overlong penalty, if any,
        added to a reward that did not fail)."""
        reward, error = scored[0], scored[1]
        terms = scored[2] if len(scored) > 2 else None
        if self.overlong is not None:
            terms = terms if terms is not None else RewardTerms()
            penalty = self.overlong(len(c.token_ids))
            terms.values[OVERLONG_TERM] = penalty
            if error is None:
                reward += penalty
        return Sample(
            prompt=self.prompt(row),
            completion=c.text,
            prompt_ids=c.prompt_token_ids,
            completion_ids=c.token_ids,
            gen_logprobs=c.logprobs,
            reward=reward,
            group_id=group_id,
            policy_version=c.policy_version,
            fields=row_fields(row, self.prompt_field),
            finished=c.finish_reason == "stop",
            reward_error=error,
            token_versions=c.token_versions,
            routed_experts=c.routed_experts,
            reward_terms=terms,
        )


def scored_summary(scored: list[Scored], correct_threshold: float, policy_version: int) -> dict[str, Any]:
    """What a worker's `evaluate` returns for greedy (reward, error) pairs (see `eval_summary`)."""
    return eval_summary([s[0] for s in scored], correct_threshold, policy_version, [s[1] for s in scored])
