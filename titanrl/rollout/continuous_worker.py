"""ContinuousRolloutWorker: generates group by group and takes new weights without stopping.

It runs as an async Ray actor, on the actor's own event loop: a single `AsyncGenerator` pump
steps vLLM (on a thread of its own) for every request in flight. So the groups of the driver's
`generate_groups` calls (`titanrl.rollout.group_stream`: a worker's share of an admission in one
streaming call) share one continuous batch, a group that finishes is streamed back at once, and
`update_weights` lands between two engine steps while the other groups keep going:

- `rollout.on_weight_update="continue"` (partial rollouts): running requests keep their tokens,
  vLLM recomputes their KV cache with the new weights, and each token records the version that
  sampled it (`Sample.token_versions`); the trainer's behaviour policy is the generator's logprobs.
- `"regenerate"`: running requests are aborted and their groups start again with the new weights.

Everything but the engine runs on Ray's loop. The worker used to keep a second loop on a thread
of its own (from when the pump stepped vLLM on the loop, which would have blocked Ray's): one
more Python thread taking the GIL between the engine thread's torch calls, and a cross-thread
hop per group each way. On the arithmetic example's batches, in one process, dropping it took
continuous generation from 0.89-0.94x to 0.97-1.01x lock-step's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from titanrl.rollout.group_stream import GroupStream
from titanrl.rollout.single_turn import scored_summary
from titanrl.rollout.vllm.async_engine import AsyncGenerator, WeightsChanged
from titanrl.rollout.worker import RolloutWorker
from titanrl.types import Group


class ContinuousRolloutWorker(GroupStream, RolloutWorker):
    """RolloutWorker's engine, rewards and environments, driven one group at a time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Arguments as RolloutWorker's; `rollout.on_weight_update` and `rollout.defer_weight_loads` apply."""
        super().__init__(*args, **kwargs)
        self.regenerate = self.cfg.on_weight_update == "regenerate"
        self.generator = AsyncGenerator(self.engine, defer_loads=self.cfg.defer_weight_loads)
        self._started: asyncio.Future[None] | None = None
        self._updates = asyncio.Lock()  # held by weight loads and by an evaluation (its whole batch sees one version)

    def _start_environments(self) -> None:
        pass  # the sandboxes start on the actor's loop, which episodes then use (`_start`)

    async def _start(self) -> None:
        """Once, on the actor's event loop (every async method awaits this first): the generator's
        pump and an env worker's sandboxes."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start_once())
        await asyncio.shield(self._started)

    async def _start_once(self) -> None:
        if self.episodes is not None:
            await self.episodes.start()
        await self.generator.__aenter__()

    async def ready(self) -> dict[str, float]:
        """Returns once the engine, the pump and any sandboxes are up (the driver waits on this)."""
        await self._start()
        return super().ready()

    # ------------------------------------------------------------------ generation

    async def generate_group(self, row: dict[str, Any], seed: int, group_id: int, min_version: int) -> Group:
        """`group_size` scored samples (or episodes) of `row`, started from weights >= `min_version`.

        `seed` is `titanrl.rollout.seeds.request_seed(run_seed, group_id, group_size, turns)`.
        """
        await self._start()
        # Tokenized while the group may still wait for its weights (the engine is busy with the
        # last batch then), not after, when the engine waits for this batch to start.
        prompt_ids = None if self.episodes is not None else self.engine.tokenize([self.single_turn.prompt(row)])[0]
        await self.generator.wait_for_version(min_version, requests=self.cfg.group_size)
        while True:
            try:
                if prompt_ids is None:
                    return await self.episodes.generate_group(row, seed, group_id, self.generator)
                return await self._single_turn_group(row, prompt_ids, seed, group_id)
            except WeightsChanged:
                continue  # on_weight_update="regenerate": start the group over with the new weights

    async def _single_turn_group(self, row: dict[str, Any], prompt_ids: list[int], seed: int, group_id: int) -> Group:
        completions = await self.generator.generate_n(prompt_ids, n=self.cfg.group_size, seed=seed,
                                                      **self.single_turn.sampling(self.cfg))
        scored = await self.scorer.score_results_async(self.single_turn.to_score([row], [completions]))
        (group,) = self.single_turn.groups([row], [completions], scored, group_id)
        return group

    # ------------------------------------------------------------------ weights and evaluation

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> float:
        """Loads new weights between two engine steps, groups in flight; returns the load time."""
        await self._start()
        async with self._updates:
            await self.generator.update_weights(state_dict, version, regenerate=self.regenerate)
        return self.engine.last_push_seconds or 0.0

    async def open_weight_sync(self, plan: Any, rank: int) -> None:
        """RolloutWorker's, between two engine steps (on the engine's thread: see AsyncGenerator)."""
        await self._start()
        return await self.generator.on_engine(super().open_weight_sync, plan, rank)

    async def receive_weights(self, announcement: Any, version: int) -> float:
        """Loads an announced version (`titanrl.weight_sync`) between two engine steps, groups in flight."""
        await self._start()
        seconds: list[float] = []
        async with self._updates:
            await self.generator.apply_update(
                lambda: seconds.append(self.weight_receiver.receive(announcement, version, recompute_running=True)),
                version, regenerate=self.regenerate)
        return seconds[0]

    async def close_weight_sync(self) -> None:
        await self._start()
        return await self.generator.on_engine(super().close_weight_sync)

    async def evaluate(self, rows: list[dict[str, Any]], max_new_tokens: int, correct_threshold: float,
                       min_version: int = 0) -> dict[str, Any]:
        """Greedy rewards of held-out rows under one policy version (>= `min_version`), generated
        alongside the training groups; weight updates wait until it is done."""
        await self._start()
        await self.generator.wait_for_version(min_version, requests=len(rows))
        async with self._updates:
            if self.episodes is not None:
                return await self.episodes.evaluate_async(rows, correct_threshold, self.generator)
            completions = await asyncio.gather(*(
                self.generator.generate(self.single_turn.prompt(row), **self.single_turn.greedy(max_new_tokens))
                for row in rows
            ))
            scored = await self.scorer.score_async(self.single_turn.to_score(rows, [[c] for c in completions]))
            return scored_summary(scored, correct_threshold, self.engine.policy_version)

    async def close(self) -> None:
        """Stops the pump (aborting what is in flight) and the sandboxes on the actor's loop, then
        the engine and reward helpers."""
        if self._started is not None and self._started.done() and self._started.exception() is None:
            await self.generator.__aexit__(None, None, None)
        if self.episodes is not None:
            await self.episodes.close_pool()
        super().close()
