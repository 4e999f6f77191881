"""RolloutWorker: one vLLM engine, sampling prompt groups and scoring them.

Plain Python class; the driver runs it as a Ray actor. Ray executes an actor's calls in
submission order, so a weight push queued after a generate request lands after it and
before the next one: a request never mixes two policy versions.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from titanrl.busy_flags import BusySlot
from titanrl.config import resolve_env_factory, resolve_reward
from titanrl.config.resolve import ResolvedRunConfig
from titanrl.config.unplanned import concrete_engine
from titanrl.memory import peak_rss_gib
from titanrl.rollout.run_scorer import run_scorer
from titanrl.rollout.single_turn import OverlongPenalty, SingleTurn, scored_summary
from titanrl.types import RolloutBatch, group_tokens


class RolloutWorker:
    """Owns one engine; generates and scores groups; accepts weight pushes."""

    def __init__(self, worker_id: int, resolved: ResolvedRunConfig, *, busy_flags: str | None = None) -> None:
        """Worker `worker_id` of the run `resolved` (`titanrl.config.resolve`): it reads its settings
        from there and resolves none. Rewards come from `rewards`/`reward_weights`; a reward call (or an
        episode's environment) that fails gives its sample `scoring.error_value` instead of crashing
        the run (`titanrl.rewards.scoring`); all samples of a request are scored concurrently
        (`titanrl.rewards.batch_scoring`). The engine runs `rollout.engine` in the generator dtype (the
        trainer's compute dtype, which pushed weights arrive in), through `titanrl.kernels` under
        `batch_invariant`. `busy_flags`: the run's `titanrl.busy_flags` file; the engine raises this
        worker's byte while it samples (train.compute.threads_when_rollouts_idle)."""
        config = resolved.config
        rc = config.rollout
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(concrete_engine(rc.engine).kv_cache_gib)))
        torch.set_num_threads(rc.engine.threads)
        # vLLM's CPU worker replaces torch.set_num_threads with a stub that warns on every
        # call (its tokenizer path calls it per request); the thread count is set here.
        logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(
            lambda record: "set_num_threads" not in record.getMessage()
        )
        from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig, adapter_sync

        self.worker_id, self.cfg, self.prompt_field = worker_id, rc, config.data.prompt_field
        self.rewards = [resolve_reward(r, i) for i, r in enumerate(config.rewards)]
        # Helper threads start on first use, so an episode worker (EnvRunner scores) pays nothing.
        self.scorer = run_scorer(self.rewards, config)
        self.engine = VllmEngine(VllmEngineConfig(
            checkpoint=config.model.checkpoint, dtype=config.generator_dtype, settings=rc.engine,
            seed=config.seed + 1000 * worker_id, batch_invariant=config.batch_invariant,
            logprobs=rc.sampling.logprobs, lora=adapter_sync(config.lora),
        ))
        self.engine.activity = BusySlot.open(busy_flags, worker_id)
        self.eos_id = self.engine.model_config.eos_token_id
        self.single_turn = SingleTurn(self.prompt_field, [self.eos_id] if self.eos_id is not None else None,
                                      OverlongPenalty.of(rc))
        from titanrl.rollout.weight_receiver import WeightReceiver

        # object_store needs no set-up; the other transports are joined with open_weight_sync.
        self.weight_receiver = WeightReceiver(self.engine)
        self.episodes: Any = None
        """Runs this worker's rollouts as episodes: an `EnvRunner` (env.factory) or an `AgentRunner`
        (agent.fn); None for single-turn completions."""
        if config.agent.fn is not None:
            from titanrl.rollout.agent_runner import AgentRunner

            self.episodes = AgentRunner(self.engine, config, worker_id)
        elif config.env.factory is not None:
            from titanrl.rollout.env_runner import EnvRunner

            self.episodes = EnvRunner(self.engine, resolve_env_factory(config.env.factory), config, self.rewards,
                                      worker_id)
        if self.episodes is not None:
            self._start_environments()

    def _start_environments(self) -> None:
        """Starts the episode runner's sandboxes (and an agent's endpoint) now, so a worker that
        cannot run them fails at start-up."""
        self.episodes.start_blocking()

    def ready(self) -> dict[str, float]:
        """Returns once the engine is up (the driver waits on this)."""
        return {"worker_id": self.worker_id, "start_s": self.engine.start_seconds}

    def generate(self, rows: list[dict[str, Any]], seed: int, first_group_id: int) -> RolloutBatch:
        """Samples `group_size` completions (or episodes) for each row and scores them.

        `seed` is `titanrl.rollout.seeds.request_seed(run_seed, first_group_id, group_size,
        max_turns)`: sample i of row j uses `seed + j * group_size + i` (episodes: see EnvRunner).
        """
        if self.episodes is not None:
            return self.episodes.generate(rows, seed, first_group_id)
        start = time.perf_counter()
        outputs = self.engine.generate([self.single_turn.prompt(row) for row in rows], n=self.cfg.group_size,
                                       seed=seed, **self.single_turn.sampling(self.cfg))
        # vLLM returns the whole batch at once, so scoring starts after generation (no overlap).
        scoring_s = self.scorer.seconds
        scored = self.scorer.score_results(self.single_turn.to_score(rows, outputs))
        groups = self.single_turn.groups(rows, outputs, scored, first_group_id)
        return RolloutBatch(groups, sum(group_tokens(g) for g in groups), time.perf_counter() - start,
                            self.engine.policy_version, reward_seconds=self.scorer.seconds - scoring_s,
                            peak_rss_gib=peak_rss_gib())

    def evaluate(self, rows: list[dict[str, Any]], max_new_tokens: int, correct_threshold: float) -> dict[str, Any]:
        """Greedy completions of held-out rows: rewards, how many are correct, how many errored."""
        if self.episodes is not None:
            return self.episodes.evaluate(rows, correct_threshold)
        outputs = self.engine.generate([self.single_turn.prompt(row) for row in rows], n=1,
                                       **self.single_turn.greedy(max_new_tokens))
        scored = self.scorer.score(self.single_turn.to_score(rows, outputs))
        return scored_summary(scored, correct_threshold, self.engine.policy_version)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Loads the trainer's weights in place; returns the push time in seconds."""
        self.engine.update_weights(state_dict, version)
        return self.engine.last_push_seconds or 0.0

    def policy_version(self) -> int:
        return self.engine.policy_version

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.scorer.close()
        self.engine.close()

    # --- weight sync (titanrl.weight_sync) ------------------------------------------------
    def open_weight_sync(self, plan: Any, rank: int) -> None:
        """Joins the trainer's weight transport as receiver `rank` (1..plan.num_receivers); for
        'broadcast' it returns once the trainer and every worker have joined (call them together)."""
        self.weight_receiver.open(plan, rank)

    def receive_weights(self, announcement: Any, version: int) -> float:
        """Loads the version `trainer.publish_weights(version)` announced; returns the seconds it took."""
        return self.weight_receiver.receive(announcement, version)

    def close_weight_sync(self) -> None:
        """Leaves the transport (broadcast group, mapped segments); idempotent."""
        self.weight_receiver.close()
