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

import numpy as np

from titanrl.envs.base import Environment, StepResult
from titanrl.rewards.scoring import as_reward
from titanrl.rollout.vllm.async_engine import AsyncGenerator
from titanrl.rollout.vllm.routing_record import fit_routing, merge_routing


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
    """First observation (the environment's prompt), or the row's prompt if the env never started."""
    prompt_ids: list[int]
    """Tokens of `prompt`, as the generator consumed them."""
    completion_ids: list[int]
    """Model turns and inserted observations, in order (empty if the env never started)."""
    loss_mask: list[int]
    """1 for model tokens, 0 for observation tokens."""
    gen_logprobs: list[float]
    """Generator logprob of each model token; 0.0 for observation tokens."""
    completion_text: str
    """Decoded turns and observations (plus an error note when the environment failed):
    the texts of `transcript` joined."""
    reward: float
    """Sum of the environment's step rewards; `error_value` when the environment failed."""
    turns: int
    """Model turns taken."""
    finished: bool
    """True when the environment ended the episode (not a budget, not an error)."""
    policy_version: int
    """Oldest weights version among its model tokens (the engine's version if it has none)."""
    stats: dict[str, float] = field(default_factory=dict)
    """tool_calls, errors, sandbox_s summed over turns; env_s spent inside env.step."""
    error: str | None = None
    """Why the environment failed (factory, reset, step, its reward, or close), if it did."""
    token_versions: list[int] = field(default_factory=list)
    """Per completion token, the weights version that sampled it; an observation token gets the
    version of the model token before it."""
    transcript: list[dict[str, str]] = field(default_factory=list)
    """`completion_text` turn by turn, in order: `{"role": "model", "text": ...}` for a model turn
    exactly as generated, `{"role": "env", "text": ...}` for an observation exactly as inserted.
    When a step fails, the last entry is the error note (role "env", text `"\\n[<error>]"`, no
    tokens behind it; `error` says the same). (Not named `turns`: that is the model-turn count.)"""
    routed_experts: np.ndarray | None = None
    """When the engine records routing: int16 [len(prompt_ids) + len(completion_ids), sparse
    layers, k], each turn's recorded routing (a later turn's where both computed a position);
    -1 where no turn computed it (prefix-cache hits, a turn's last token, a final observation)."""


_COUNTERS = ("tool_calls", "errors", "sandbox_s", "tests_passed", "tests_total")
"""StepResult.info keys summed over an episode's turns."""


def _new_stats() -> dict[str, float]:
    return {"tool_calls": 0.0, "errors": 0.0, "sandbox_s": 0.0, "env_s": 0.0, "tests_passed": 0.0, "tests_total": 0.0}


def failed_episode(prompt: str, tokenizer: Any, error: str, error_value: float, policy_version: int,
                   stats: dict[str, float] | None = None) -> Episode:
    """An episode whose environment never produced a prompt: the row's prompt, no completion.

    The sample still trains nothing (empty completion) but keeps its group complete.
    """
    stats = stats if stats is not None else _new_stats()
    stats["errors"] += 1
    # The trainer packs prompt + completion; keep at least one prompt token.
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id or 0]
    return Episode(prompt=prompt, prompt_ids=list(prompt_ids), completion_ids=[], loss_mask=[], gen_logprobs=[],
                   completion_text="", reward=error_value, turns=0, finished=False,
                   policy_version=policy_version, stats=stats, error=error)


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
    *,
    prompt_field: str = "prompt",
    error_value: float = 0.0,
    top_k: int = 0,
) -> Episode:
    """Alternates model turns and env steps until done or a budget runs out.

    Turn t samples with seed `seed + t`. An environment that fails (reset, step or close
    raising, or a step reward that is not a finite number) ends only this episode: it gets
    reward `error_value`, `stats["errors"]` counts the failure and `error` says what happened.
    Engine errors are not the environment's and propagate.
    """
    stats = _new_stats()
    version = generator.engine.policy_version
    try:
        prompt = await env.reset(row)
        if not isinstance(prompt, str):
            raise TypeError(f"reset must return the prompt text (str), got {type(prompt).__name__}")
    except Exception as e:
        error = env_error("reset", e)
        close_error = await _close(env)
        if close_error:
            stats["errors"] += 1
            error += "; " + close_error
        return failed_episode(str(row.get(prompt_field, "")), tokenizer, error, error_value, version, stats)

    errors: list[str] = []
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    context = list(prompt_ids)
    completion_ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    transcript: list[dict[str, str]] = []
    routing: np.ndarray | None = None
    reward, turns, finished = 0.0, 0, False
    try:
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
                top_k=top_k,
                max_tokens=room,
                seed=None if seed is None else seed + turns,
                stop=env.stop_strings,
                stop_token_ids=stop_token_ids,
            )
            turns += 1
            if turn.routed_experts is not None:  # turn t's request covers context + its tokens
                routing = merge_routing(routing, turn.routed_experts)
            versions += turn.token_versions or [turn.policy_version] * len(turn.token_ids)
            context += turn.token_ids
            completion_ids += turn.token_ids
            mask += [1] * len(turn.token_ids)
            logprobs += turn.logprobs
            transcript.append({"role": "model", "text": turn.text})
            t0 = time.perf_counter()
            try:  # a buggy environment ends this episode, not the run
                result = await env.step(turn.text)
                if not isinstance(result, StepResult):
                    raise TypeError(f"step must return a StepResult, got {type(result).__name__}")
                step_reward = _step_reward(result.reward)
                if not result.done and not isinstance(result.observation, str):
                    raise TypeError(f"step observation must be a str, got {type(result.observation).__name__}")
                counters = {key: float(result.info.get(key, 0)) for key in _COUNTERS}
            except _BadReward as e:
                errors.append(f"environment step {e}")
            except Exception as e:
                errors.append(env_error("step", e))
            stats["env_s"] += time.perf_counter() - t0
            if errors:
                transcript.append({"role": "env", "text": f"\n[{errors[-1]}]"})
                break
            for key, value in counters.items():
                stats[key] += value
            reward += step_reward
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
            versions += [versions[-1] if versions else version] * len(obs_ids)
            transcript.append({"role": "env", "text": result.observation})
    finally:
        close_error = await _close(env)
    if close_error:
        errors.append(close_error)
    stats["errors"] += len(errors)
    if routing is not None:  # observations after the last turn were never computed
        routing = fit_routing(routing, len(prompt_ids) + len(completion_ids), *routing.shape[1:])
    return Episode(
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        completion_ids=completion_ids,
        loss_mask=mask,
        gen_logprobs=logprobs,
        completion_text="".join(part["text"] for part in transcript),
        reward=error_value if errors else reward,
        turns=turns,
        finished=finished and not errors,
        policy_version=min((v for v, m in zip(versions, mask, strict=True) if m), default=version),
        stats=stats,
        error="; ".join(errors) or None,
        token_versions=versions,
        transcript=transcript,
        routed_experts=routing,
    )


class _BadReward(Exception):
    """A step reward that is not a finite real number."""


def _step_reward(value: Any) -> float:
    try:
        return as_reward(value)
    except (TypeError, ValueError) as e:
        raise _BadReward(f"reward {e}") from None


async def _close(env: Environment) -> str | None:
    """Closes the environment; a failure comes back as an error text, never raised."""
    try:
        await env.close()
    except Exception as e:
        return env_error("close", e)
    return None


def env_error(what: str, e: BaseException, limit: int = 300) -> str:
    """The error text of an environment call that raised: 'environment {what} raised Type: message'."""
    text = str(e) or "(no message)"
    return f"environment {what} raised {type(e).__name__}: " + (text if len(text) <= limit else text[:limit] + "...")
