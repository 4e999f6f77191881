"""Runs a batch of multi-turn episodes concurrently inside one rollout worker.

Every episode of every group is its own asyncio task; an `AsyncGenerator` pump steps vLLM
for whichever episodes are waiting on the model, while others wait on their environments.
The worker keeps one event loop (and one pre-warmed SandboxPool on it) for its whole life, so
sandboxes are started once, not per batch: the runner's own loop for a lock-step worker
(`start_blocking`), the actor's loop for a continuous one (`start`). An episode's extra rewards are scored as soon as
it ends, on the same loop, while the other episodes keep generating.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from titanrl.config import RewardFn, RunConfig
from titanrl.envs.base import EnvContext, EnvFactory
from titanrl.memory import peak_rss_gib
from titanrl.rewards.batch_scoring import ToScore
from titanrl.rewards.scoring import row_fields
from titanrl.rollout.episode import (
    Episode,
    EpisodeBudget,
    env_error,
    failed_episode,
    run_episode,
)
from titanrl.rollout.own_loop import OwnLoop
from titanrl.rollout.run_scorer import run_scorer
from titanrl.rollout.seeds import episode_seed
from titanrl.rollout.single_turn import Scored, scored_summary
from titanrl.rollout.stop_tokens import turn_stop_token_ids
from titanrl.rollout.vllm.async_engine import AsyncGenerator
from titanrl.rollout.vllm.engine import VllmEngine
from titanrl.types import Group, RolloutBatch, Sample, group_tokens


class EnvRunner(OwnLoop):
    """Turns dataset rows into groups of scored episodes."""

    def __init__(self, engine: VllmEngine, env_factory: EnvFactory, config: RunConfig, rewards: list[RewardFn],
                 worker_id: int) -> None:
        """Episodes of `config.env` on `engine`, sampled as `config.rollout` says and scored by `rewards`
        (resolved callables, weighted by `config.reward_weights`) under `config.scoring`."""
        env_config = config.env
        self.engine, self.env_factory, self.cfg, self.rc = engine, env_factory, env_config, config.rollout
        self.rewards, self.prompt_field = rewards, config.data.prompt_field
        # A failing reward function or environment gives its sample this instead of crashing.
        self.reward_error_value = config.scoring.error_value
        self.scorer = run_scorer(rewards, config)
        self.tokenizer = engine.llm.get_tokenizer()
        # A turn ends at eos, or at <|im_end|> for chat models whose eos is <|endoftext|>.
        self.stop_token_ids = turn_stop_token_ids(self.tokenizer, engine.model_config.eos_token_id)
        self.pool = None
        if env_config.sandbox_pool_size > 0:
            from titanrl.envs import SandboxPool

            self.pool = SandboxPool(size=env_config.sandbox_pool_size)
        self._pool_started = False
        self.context = EnvContext(sandbox_pool=self.pool, worker_id=worker_id, tokenizer=self.tokenizer)

    @property
    def started(self) -> bool:
        return self._pool_started

    async def start(self) -> None:
        """Starts the sandbox pool on the running event loop, which every episode must then use
        (its sandboxes' pipes belong to that loop); idempotent."""
        if self.pool is not None and not self._pool_started:
            await self.pool.start()
            self._pool_started = True

    def _budget(self) -> EpisodeBudget:
        return EpisodeBudget(
            max_turns=self.cfg.max_turns,
            max_total_tokens=self.cfg.max_total_tokens,
            max_tokens_per_turn=self.rc.sampling.max_new_tokens,
            max_model_len=self.rc.engine.max_model_len,
        )

    async def _episodes(self, rows: list[dict[str, Any]], n: int, temperature: float, seed: int | None,
                        generator: AsyncGenerator | None = None) -> list[tuple[Episode, Scored]]:
        """Every episode of every row with its (reward, error), in row order (on `generator`, or
        on one made for this call)."""
        if generator is None:
            async with AsyncGenerator(self.engine) as own:
                return await self._episodes(rows, n, temperature, seed, own)
        tasks = [
            self._episode(
                row,
                generator,
                temperature,
                # One seed per (episode, turn) of the run: see titanrl.rollout.seeds.
                None if seed is None else episode_seed(seed, j * n + i, self.cfg.max_turns),
            )
            for j, row in enumerate(rows)
            for i in range(n)
        ]
        # Every episode ends (none is left running unowned) before an error of one is raised.
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _episode(self, row: dict[str, Any], generator: AsyncGenerator, temperature: float,
                       seed: int | None) -> tuple[Episode, Scored]:
        episode = await self._run(row, generator, temperature, seed)
        return episode, await self._score(episode, row)

    async def _run(self, row: dict[str, Any], generator: AsyncGenerator, temperature: float,
                   seed: int | None) -> Episode:
        try:
            env = self.env_factory(self.context)
        except Exception as e:  # a broken factory costs this episode, not the run
            return failed_episode(str(row.get(self.prompt_field, "")), self.tokenizer, env_error("factory", e),
                                  self.reward_error_value, self.engine.policy_version)
        return await run_episode(
            env,
            row,
            generator,
            self.tokenizer,
            self._budget(),
            temperature=temperature,
            top_p=self.rc.sampling.top_p if temperature > 0 else 1.0,
            top_k=self.rc.sampling.top_k if temperature > 0 else 0,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            prompt_field=self.prompt_field,
            error_value=self.reward_error_value,
        )

    async def _score(self, episode: Episode, row: dict[str, Any]) -> Scored:
        """The episode's reward plus the extra reward functions' (and their terms); an env or reward
        error gives error_value."""
        if episode.error is not None:  # its reward is already error_value; rewards would see a broken transcript
            return episode.reward, episode.error
        if not self.rewards:
            return episode.reward, None
        ((extra, error, terms),) = await self.scorer.score_results_async(
            [ToScore(episode.prompt, episode.completion_text, row_fields(row, self.prompt_field))]
        )
        return (extra, error, terms) if error is not None else (episode.reward + extra, None, terms)

    def generate(self, rows: list[dict[str, Any]], seed: int, first_group_id: int) -> RolloutBatch:
        """`seed` is `titanrl.rollout.seeds.request_seed(run_seed, first_group_id, group_size, env.max_turns)`."""
        start, scoring_s = time.perf_counter(), self.scorer.seconds
        n = self.rc.group_size
        episodes = self.run_blocking(self._episodes(rows, n, self.rc.sampling.temperature, seed))
        groups = [self._group(row, episodes[j * n : (j + 1) * n], first_group_id + j) for j, row in enumerate(rows)]
        return RolloutBatch(groups, sum(group_tokens(g) for g in groups), time.perf_counter() - start,
                            self.engine.policy_version, reward_seconds=self.scorer.seconds - scoring_s,
                            peak_rss_gib=peak_rss_gib())

    async def generate_group(self, row: dict[str, Any], seed: int, group_id: int, generator: AsyncGenerator) -> Group:
        """One row's `group_size` scored episodes on a running generator (`rollout.continuous`)."""
        episodes = await self._episodes([row], self.rc.group_size, self.rc.sampling.temperature, seed, generator)
        return self._group(row, episodes, group_id)

    def _group(self, row: dict[str, Any], episodes: list[tuple[Episode, Scored]],
               group_id: int) -> Group:
        fields = row_fields(row, self.prompt_field)
        return Group([
            Sample(
                prompt=ep.prompt,
                completion=ep.completion_text,
                prompt_ids=ep.prompt_ids,
                completion_ids=ep.completion_ids,
                gen_logprobs=ep.gen_logprobs,
                reward=scored[0],
                group_id=group_id,
                policy_version=ep.policy_version,
                fields=fields,
                finished=ep.finished,
                loss_mask=ep.loss_mask,
                stats={"turns": float(ep.turns), **ep.stats},
                reward_error=scored[1],
                token_versions=ep.token_versions,
                turns=ep.transcript,
                routed_experts=ep.routed_experts,
                reward_terms=scored[2] if len(scored) > 2 else None,
            )
            for ep, scored in episodes
        ])

    def evaluate(self, rows: list[dict[str, Any]], correct_threshold: float) -> dict[str, Any]:
        return self.run_blocking(self.evaluate_async(rows, correct_threshold))

    async def evaluate_async(self, rows: list[dict[str, Any]], correct_threshold: float,
                             generator: AsyncGenerator | None = None) -> dict[str, Any]:
        """Greedy episodes of held-out rows (on `generator` if given): rewards, correct count, errors."""
        scored = [s for _, s in await self._episodes(rows, 1, 0.0, None, generator)]
        return scored_summary(scored, correct_threshold, self.engine.policy_version)

    async def close_pool(self) -> None:
        """Stops the sandbox pool on the loop it was started on (the running one)."""
        if self.pool is not None and self._pool_started:
            await self.pool.close()
            self._pool_started = False

    def close(self) -> None:
        """Stops the pool if it runs on the runner's own loop (an async caller awaits `close_pool`
        first), and the reward helpers."""
        self.close_loop(self.close_pool())
        self.scorer.close()
