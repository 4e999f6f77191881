"""Multi-turn episodes on the real vLLM engine: token-in/token-out, masks, budgets, concurrency.

The environments here are small scripted ones: what is under test is the episode loop
and the async generator around the engine, not an environment.
"""

import asyncio
import itertools

import pytest
import torch

from titanrl.envs.base import Environment, StepResult
from titanrl.models.hf_checkpoint import load_model
from titanrl.rollout.episode import EpisodeBudget, run_episode
from titanrl.rollout.vllm.async_engine import AsyncGenerator
from titanrl.trainer.grpo import token_logprobs


_FINISH_ORDER = itertools.count()
"""Numbers the environments' final steps in the order they happen."""


class CountingEnv(Environment):
    """Answers every model turn with a fixed observation; ends after `turns` turns with reward 1."""

    def __init__(self, turns: int = 3, observation: str = "\n<obs>ok</obs>\n") -> None:
        self.turns, self.observation = turns, observation
        self.seen: list[str] = []
        self.closed = False
        self.finished_at: int | None = None
        """Position among all environments' last steps (an ordering, not a time)."""

    async def reset(self, row):
        return row["prompt"]

    async def step(self, action):
        self.seen.append(action)
        if len(self.seen) >= self.turns:
            self.finished_at = next(_FINISH_ORDER)
            return StepResult(observation="", reward=1.0, done=True, info={"tool_calls": 1})
        return StepResult(observation=self.observation, reward=0.0, done=False, info={"tool_calls": 1, "sandbox_s": 0.01})

    async def close(self):
        self.closed = True


def _budget(**overrides) -> EpisodeBudget:
    base = dict(max_turns=8, max_total_tokens=200, max_tokens_per_turn=6, max_model_len=256)
    base.update(overrides)
    return EpisodeBudget(**base)


def _run(engine, envs, budget, temperature=1.0):
    async def main():
        tokenizer = engine.llm.get_tokenizer()
        async with AsyncGenerator(engine) as gen:
            return await asyncio.gather(
                *(
                    run_episode(env, {"prompt": f"q{i}:"}, gen, tokenizer, budget, temperature, 1.0, seed=10 * i, stop_token_ids=None)
                    for i, env in enumerate(envs)
                )
            )

    return asyncio.run(main())


def test_episode_masks_observations_and_keeps_sampled_tokens(vllm_engine, vllm_tiny_checkpoint):
    """Model tokens keep their sampled ids and logprobs (equal to our forward's); observation tokens are masked."""
    env = CountingEnv(turns=3)
    (ep,) = _run(vllm_engine, [env], _budget())
    assert ep.turns == 3 and ep.finished and ep.reward == 1.0 and env.closed
    assert ep.stats["tool_calls"] == 3 and ep.stats["sandbox_s"] == pytest.approx(0.02)
    tokenizer = vllm_engine.llm.get_tokenizer()
    obs_ids = tokenizer.encode(env.observation, add_special_tokens=False)
    assert ep.loss_mask.count(0) == 2 * len(obs_ids)  # two observations between three turns
    assert len(ep.loss_mask) == len(ep.completion_ids) == len(ep.gen_logprobs)
    # The masked spans are exactly the observation's tokens.
    zeros = [t for t, m in zip(ep.completion_ids, ep.loss_mask, strict=True) if m == 0]
    assert zeros == obs_ids * 2
    # Token-in/token-out: the trainer's forward over the very same ids gives the generator's logprobs.
    model, _ = load_model(vllm_tiny_checkpoint)
    seq = torch.tensor([ep.prompt_ids + ep.completion_ids])
    with torch.no_grad():
        lp = token_logprobs(model(seq[:, :-1]), seq[:, 1:])[0, len(ep.prompt_ids) - 1 :]
    mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
    torch.testing.assert_close(lp[mask], torch.tensor(ep.gen_logprobs)[mask], atol=1e-4, rtol=0)


def test_budgets_end_long_episodes(vllm_engine):
    """max_turns and max_total_tokens stop an environment that never says done."""
    env = CountingEnv(turns=100)
    (ep,) = _run(vllm_engine, [env], _budget(max_turns=2))
    assert ep.turns == 2 and not ep.finished and env.closed
    env = CountingEnv(turns=100)
    (ep,) = _run(vllm_engine, [env], _budget(max_total_tokens=20))
    assert len(ep.completion_ids) <= 20 and not ep.finished


class WaitsForOthers(CountingEnv):
    """Its first tool call returns only once every environment in `others` has finished (polled;
    after 60 s it gives up, a hang guard, and `waited` stays False)."""

    def __init__(self, others: list[CountingEnv]) -> None:
        super().__init__(turns=2)
        self.others, self.waited = others, False

    async def step(self, action):
        if not self.seen:
            for _ in range(6000):
                if all(o.finished_at is not None for o in self.others):
                    self.waited = True
                    break
                await asyncio.sleep(0.01)
        return await super().step(action)


def test_slow_tool_does_not_stall_other_episodes(vllm_engine):
    """While one episode's tool call is pending, the others run all their turns and finish: the
    tool call returns only after they did, so had they waited for it, nothing would finish."""
    fast = [CountingEnv(turns=4) for _ in range(6)]
    slow = WaitsForOthers(fast)
    episodes = _run(vllm_engine, [slow, *fast], _budget())
    assert all(ep.finished for ep in episodes)
    assert slow.waited
    assert max(env.finished_at for env in fast) < slow.finished_at


def test_env_exception_ends_only_that_episode(vllm_engine):
    """An environment that raises gives a zero-reward, error-counted episode; the others complete."""

    class Broken(CountingEnv):
        async def step(self, action):
            raise RuntimeError("tool crashed")

    broken, fine = Broken(), CountingEnv(turns=2)
    ep_broken, ep_fine = _run(vllm_engine, [broken, fine], _budget())
    assert ep_broken.reward == 0.0 and ep_broken.stats["errors"] == 1 and broken.closed
    assert ep_broken.error == "environment step raised RuntimeError: tool crashed" and not ep_broken.finished
    assert ep_fine.finished and ep_fine.reward == 1.0
