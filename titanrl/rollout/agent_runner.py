"""Runs agent episodes inside one rollout worker: `agent(base_url, api_key, row)` per episode,
served by the worker's own OpenAI-compatible endpoint (titanrl/agents).

The interface is `EnvRunner`'s (`generate`, `generate_group`, `evaluate(_async)`, `start`,
`start_blocking`, `close_pool`, `close`), so lock-step and continuous workers take either. The
endpoint, the sandbox pool and every episode live on one event loop with the engine's pump: the
runner's own loop for a lock-step worker, the actor's for a continuous one. An async agent runs
as a task on that loop; a sync one in a thread of the runner's pool (the default executor has
only a few threads, and every episode of a step runs at once).

An episode's samples are assembled from the calls it made, token for token, by the rule in
`titanrl.agents.calls`; each carries the episode's reward. An agent that raises or runs past
`agent.timeout_s` is a contained reward error (`scoring.error_value`), as a failing reward is;
its calls after that are refused.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from titanrl.agents.calls import EpisodePieces, assemble
from titanrl.agents.episodes import AgentEpisode, EpisodeRegistry
from titanrl.agents.handler import CallHandler, CallSettings
from titanrl.agents.sandbox import EpisodeSandbox, set_episode_sandbox
from titanrl.agents.server import EndpointServer, build_app
from titanrl.config import RunConfig, resolve_agent_fn
from titanrl.memory import peak_rss_gib
from titanrl.rewards.scoring import as_reward, row_fields
from titanrl.rollout.own_loop import OwnLoop
from titanrl.rollout.seeds import episode_seed
from titanrl.rollout.single_turn import scored_summary
from titanrl.rollout.stop_tokens import turn_stop_token_ids
from titanrl.rollout.vllm.async_engine import AsyncGenerator
from titanrl.rollout.vllm.engine import VllmEngine
from titanrl.types import Group, RolloutBatch, Sample, group_tokens


@dataclass
class AgentOutcome:
    """One finished episode: its calls assembled, and what `fn` returned."""

    episode: AgentEpisode
    pieces: EpisodePieces
    reward: float
    error: str | None
    seconds: float
    sandbox_s: float
    tool_calls: int


class AgentRunner(OwnLoop):
    """Turns dataset rows into groups of agent episodes."""

    def __init__(self, engine: VllmEngine, config: RunConfig, worker_id: int, *, check_prefix: bool = True) -> None:
        """Episodes of `config.agent` on `engine`, sampled at `config.rollout.sampling`.
        `check_prefix=False` disables the prefix check of `titanrl.agents.calls.assemble` (tests' negative control)."""
        self.engine, self.cfg, self.rc, self.worker_id = engine, config.agent, config.rollout, worker_id
        self.fn = resolve_agent_fn(config.agent.fn)
        # An async def, or an object whose __call__ is one.
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            type(self.fn).__call__)
        self.error_value, self.prompt_field = config.scoring.error_value, config.data.prompt_field
        self.check_prefix = check_prefix
        self.tokenizer = engine.llm.get_tokenizer()
        template = None
        if config.agent.chat_template is not None:
            with open(config.agent.chat_template, encoding="utf-8") as f:
                template = f.read()
        sampling = self.rc.sampling
        self.handler = CallHandler(self.tokenizer, CallSettings(
            served_model_name=config.agent.served_model_name, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
            max_model_len=self.rc.engine.max_model_len,
            stop_token_ids=turn_stop_token_ids(self.tokenizer, engine.model_config.eos_token_id),
            max_calls=config.agent.max_calls, vocab_size=engine.model_config.vocab_size, chat_template=template,
            tool_call_format=engine.spec.tool_call_format))
        self.registry = EpisodeRegistry()
        self.server = EndpointServer(build_app(self.handler, self.registry, config.agent.max_request_bytes))
        self.pool = None
        if config.agent.sandbox_pool_size > 0:
            from titanrl.envs import SandboxPool

            self.pool = SandboxPool(size=config.agent.sandbox_pool_size)
        self._started = False
        # Sync agents: one thread per concurrent episode (a step's episodes all run at once).
        self._threads = ThreadPoolExecutor(max_workers=max(4, min(256, self.rc.prompts_per_step * self.rc.group_size)),
                                           thread_name_prefix="titanrl-agent")

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def started(self) -> bool:
        return self._started

    async def start(self) -> None:
        """Starts the endpoint and the sandbox pool on the running loop (which episodes then use); idempotent."""
        if self._started:
            return
        if self.pool is not None:
            await self.pool.start()
        await self.server.start()
        self._started = True

    # ------------------------------------------------------------------ episodes
    async def _episodes(self, rows: list[dict[str, Any]], n: int, greedy: bool, seed: int | None,
                        generator: AsyncGenerator | None = None) -> list[AgentOutcome]:
        if generator is None:
            async with AsyncGenerator(self.engine) as own:
                return await self._episodes(rows, n, greedy, seed, own)
        calls = self.cfg.max_calls
        return list(await asyncio.gather(*(
            self._episode(row, generator, greedy, None if seed is None else episode_seed(seed, j * n + i, calls))
            for j, row in enumerate(rows) for i in range(n)
        )))

    async def _episode(self, row: dict[str, Any], generator: AsyncGenerator, greedy: bool,
                       seed: int | None) -> AgentOutcome:
        episode, api_key = self.registry.open(row, seed, greedy, generator)
        loop = asyncio.get_running_loop()
        sandbox = EpisodeSandbox(self.pool, loop) if self.pool is not None else None
        context = contextvars.copy_context()
        context.run(set_episode_sandbox, sandbox)
        start = time.perf_counter()
        reward, error = self.error_value, None
        if self.is_async:
            # The task runs in `context`, so the agent's own code sees this episode's sandbox.
            task = loop.create_task(self.fn(self.base_url, api_key, row), context=context)
        else:
            task = loop.run_in_executor(self._threads, context.run, self.fn, self.base_url, api_key, row)
        try:
            value = await asyncio.wait_for(task, timeout=self.cfg.timeout_s)
        except TimeoutError:
            error = f"agent timed out after agent.timeout_s={self.cfg.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - the agent's own failure costs this episode, not the run
            error = f"agent raised {type(e).__name__}: {_short(str(e))}"
        else:
            try:
                reward = as_reward(value)
            except (TypeError, ValueError) as e:
                error = f"agent returned {_short(repr(value), 80)}, not a finite number: {e}"
        finally:
            self.registry.close(episode)  # its later calls are refused
        if episode.engine_error is not None:  # the agent only saw a 500: the engine's failure is the worker's
            raise episode.engine_error
        if error is not None:
            reward = self.error_value
        pieces = assemble(episode.calls, self._decode, check_prefix=self.check_prefix)
        return AgentOutcome(episode, pieces, reward, error, time.perf_counter() - start,
                            sandbox.sandbox_s if sandbox is not None else 0.0,
                            sum(_tool_calls(call.text, self.handler.settings.tool_call_format)
                                for call in episode.calls))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ samples
    def _samples(self, outcome: AgentOutcome, group_id: int) -> list[Sample]:
        episode, row = outcome.episode, outcome.episode.row
        fields = row_fields(row, self.prompt_field)
        versions = {call.version for call in episode.calls}
        stats = {
            "turns": float(episode.num_calls), "tool_calls": float(outcome.tool_calls),
            "errors": float(outcome.error is not None), "sandbox_s": outcome.sandbox_s,
            "agent_episode": 1.0, "agent_calls": float(episode.num_calls),
            "agent_prefix_breaks": float(outcome.pieces.prefix_breaks),
            "agent_completion_tokens": float(sum(len(c.completion_ids) for c in episode.calls)),
            "agent_versions_spanned": float(len(versions)), "agent_samples": float(len(outcome.pieces.pieces)),
            "agent_resampled_calls": float(episode.resampled_calls), "agent_seconds": outcome.seconds,
        }
        if not outcome.pieces.pieces:  # no call was made: one empty sample keeps the group whole
            prompt = str(row.get(self.prompt_field, ""))
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) or [self.tokenizer.eos_token_id or 0]
            return [Sample(prompt=prompt, completion="", prompt_ids=list(ids), completion_ids=[], gen_logprobs=[],
                           reward=outcome.reward, group_id=group_id, policy_version=self.engine.policy_version,
                           fields=fields, finished=outcome.error is None, loss_mask=[], stats=stats,
                           reward_error=outcome.error, token_versions=[], turns=[])]
        samples = []
        for k, piece in enumerate(outcome.pieces.pieces):
            model_versions = [v for v, m in zip(piece.versions, piece.loss_mask, strict=True) if m]
            samples.append(Sample(
                prompt=self._decode(piece.prompt_ids), completion="".join(t["text"] for t in piece.transcript),
                prompt_ids=piece.prompt_ids, completion_ids=piece.completion_ids, gen_logprobs=piece.logprobs,
                reward=outcome.reward, group_id=group_id, policy_version=min(model_versions, default=0),
                fields=fields, finished=piece.finished and outcome.error is None, loss_mask=piece.loss_mask,
                # Episode-level counters on its first sample only, so per-step sums count episodes once.
                stats=stats if k == 0 else {"agent_episode": 0.0, "turns": float(piece.calls)},
                reward_error=outcome.error, token_versions=piece.versions, turns=piece.transcript,
            ))
        return samples

    def _group(self, outcomes: list[AgentOutcome], group_id: int) -> Group:
        return Group([s for outcome in outcomes for s in self._samples(outcome, group_id)])

    # ------------------------------------------------------------------ the EnvRunner interface
    def generate(self, rows: list[dict[str, Any]], seed: int, first_group_id: int) -> RolloutBatch:
        """`seed` is `request_seed(run_seed, first_group_id, group_size, agent.max_calls)`."""
        start = time.perf_counter()
        n = self.rc.group_size
        outcomes = self.run_blocking(self._episodes(rows, n, False, seed))
        groups = [self._group(outcomes[j * n:(j + 1) * n], first_group_id + j) for j in range(len(rows))]
        return RolloutBatch(groups, sum(group_tokens(g) for g in groups), time.perf_counter() - start,
                            self.engine.policy_version, peak_rss_gib=peak_rss_gib())

    async def generate_group(self, row: dict[str, Any], seed: int, group_id: int, generator: AsyncGenerator) -> Group:
        """One row's `group_size` episodes on a running generator (`rollout.continuous`)."""
        return self._group(await self._episodes([row], self.rc.group_size, False, seed, generator), group_id)

    def evaluate(self, rows: list[dict[str, Any]], correct_threshold: float) -> dict[str, Any]:
        return self.run_blocking(self.evaluate_async(rows, correct_threshold))

    async def evaluate_async(self, rows: list[dict[str, Any]], correct_threshold: float,
                             generator: AsyncGenerator | None = None) -> dict[str, Any]:
        """Greedy episodes (every call at temperature 0) of held-out rows: rewards, correct count, errors."""
        outcomes = await self._episodes(rows, 1, True, None, generator)
        return scored_summary([(o.reward, o.error) for o in outcomes], correct_threshold, self.engine.policy_version)

    async def close_pool(self) -> None:
        """Stops the endpoint and the sandbox pool on the loop they run on (the running one)."""
        if self._started:
            await self.server.stop()
            if self.pool is not None:
                await self.pool.close()
            self._started = False

    def close(self) -> None:
        """Stops the endpoint and the pool if they run on the runner's own loop (an async caller
        awaits `close_pool` first), and the agents' threads."""
        self.close_loop(self.close_pool())
        self._threads.shutdown(wait=False, cancel_futures=True)


def _tool_calls(text: str, tool_call_format: str) -> int:
    from titanrl.agents.handler import TOOL_CALL_FORMATS

    return text.count(TOOL_CALL_FORMATS[tool_call_format][0])


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
