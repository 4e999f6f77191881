"""Runs one multi-turn episode token-in/token-out.

The model's tokens are kept exactly as sampled, with their logprobs; environment text is
tokenized once and appended after them with loss mask 0. The trainer therefore trains on
the very token sequence the generator produced (no re-tokenization drift of the model's
own turns), and never on tokens the model did not choose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from titanrl.envs.base import Environment, StepResult
from titanrl.rollout.async_engine import AsyncGenerator


@dataclass
class EpisodeBudget:
    """Limits that end an episode even if the environment would go on."""

    max_turns: int
    """Model turns per episode."""
    max_total_tokens: int
    """Completion-side tokens per episode: model turns plus inserted observations."""
    max_tokens_per_turn: int
    """Token limit of a single model turn."""
    max_model_len: int
    """Engine context length: prompt plus everything appended must stay below it."""


@dataclass
class Episode:
    """What an episode produced, ready to become a training Sample."""

    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    gen_logprobs: list[float]
    completion_text: str
    reward: float
    turns: int
    finished: bool
    """True when the environment ended the episode (not a budget)."""
    policy_version: int
    stats: dict[str, float] = field(default_factory=dict)
    """tool_calls, errors, sandbox_s summed over turns; env_s spent inside env.step."""


async def run_episode(
    env: Environment,
    row: dict[str, Any],
    generator: AsyncGenerator,
    tokenizer: Any,
    budget: EpisodeBudget,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop_token_ids: list[int] | None,
) -> Episode:
    """Alternates model turns and env steps until done or a budget runs out."""
    stats = {"tool_calls": 0.0, "errors": 0.0, "sandbox_s": 0.0, "env_s": 0.0, "tests_passed": 0.0,
             "tests_total": 0.0}
    try:
        prompt = await env.reset(row)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        context = list(prompt_ids)
        completion_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        text_parts: list[str] = []
        reward, turns, finished, version = 0.0, 0, False, generator.engine.policy_version
        while turns < budget.max_turns:
            room = min(
                budget.max_tokens_per_turn,
                budget.max_total_tokens - len(completion_ids),
                budget.max_model_len - len(context) - 1,
            )
            if room <= 0:
                break
            turn = await generator.generate(
                context,
                temperature=temperature,
                top_p=top_p,
                max_tokens=room,
                seed=None if seed is None else seed + turns,
                stop=env.stop_strings,
                stop_token_ids=stop_token_ids,
            )
            turns += 1
            version = turn.policy_version
            context += turn.token_ids
            completion_ids += turn.token_ids
            mask += [1] * len(turn.token_ids)
            logprobs += turn.logprobs
            text_parts.append(turn.text)
            t0 = time.perf_counter()
            try:
                result = await env.step(turn.text)
            except Exception as e:  # a buggy environment ends this episode, not the run
                result = StepResult(observation="", reward=0.0, done=True, info={"errors": 1})
                stats["env_exception"] = 1.0
                text_parts.append(f"\n[environment error: {type(e).__name__}: {e}]")
            stats["env_s"] += time.perf_counter() - t0
            for key in ("tool_calls", "errors", "sandbox_s", "tests_passed", "tests_total"):
                stats[key] += float(result.info.get(key, 0))
            reward += float(result.reward)
            if result.done:
                finished = True
                break
            obs_ids = tokenizer.encode(result.observation, add_special_tokens=False)
            room = min(budget.max_model_len - len(context) - 1, budget.max_total_tokens - len(completion_ids))
            if len(obs_ids) >= room:
                # No room left for the model to answer the observation: the budget ends it.
                obs_ids = obs_ids[: max(room, 0)]
                stats["truncated_observation"] = 1.0
            context += obs_ids
            completion_ids += obs_ids
            mask += [0] * len(obs_ids)
            logprobs += [0.0] * len(obs_ids)
            text_parts.append(result.observation)
    finally:
        await env.close()
    return Episode(
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        completion_ids=completion_ids,
        loss_mask=mask,
        gen_logprobs=logprobs,
        completion_text="".join(text_parts),
        reward=reward,
        turns=turns,
        finished=finished,
        policy_version=version,
        stats=stats,
    )
