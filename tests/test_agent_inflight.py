"""In-flight weight updates under agent episodes (continuous rollouts): the version changes between
an episode's calls, never inside one, and every call records the one version that sampled it.
Real vLLM (the session's tiny engine), the real endpoint and the real `openai` client."""

from __future__ import annotations

import asyncio

import openai
import pytest

import titanrl
from titanrl.config import EngineConfig

pytest.importorskip("vllm")


async def _four_long_calls(base_url, api_key, row):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    for _ in range(4):
        await client.completions.create(model="policy", prompt=[5, 6, 7, 8], max_tokens=40)
    return 1.0


def _config(checkpoint, on_weight_update: str) -> titanrl.RunConfig:
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(checkpoint)),
        agent=titanrl.AgentConfig(fn=_four_long_calls),
        rollout=titanrl.RolloutConfig(group_size=1, prompts_per_step=1, on_weight_update=on_weight_update,
                                      engine=EngineConfig(max_model_len=256, max_num_seqs=32)),
    )


async def _episode_with_a_push_mid_call(runner, engine, state, version):
    """One episode; new weights are pushed once its second call has sampled 10 tokens."""
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    await runner.start()
    try:
        async with AsyncGenerator(engine) as generator:
            group = asyncio.ensure_future(runner.generate_group({"prompt": "x"}, 17, 0, generator))
            while True:
                episodes = list(runner.registry._live.values())
                tokens = (await generator.running_tokens()).values()
                if episodes and episodes[0].num_calls == 1 and max(tokens, default=0) >= 10:
                    break
                await asyncio.sleep(0)
            await generator.update_weights(state, version, regenerate=runner.rc.on_weight_update == "regenerate")
            return await group
    finally:
        await runner.close_pool()


@pytest.mark.parametrize("on_weight_update", ["continue", "regenerate"])
def test_new_weights_mid_call_change_the_version_between_calls_never_inside_one(vllm_engine, vllm_tiny_checkpoint,
                                                                                on_weight_update):
    """A push lands while call 2 of 4 runs: that call is sampled again from its start with the new
    weights (counted in agent_resampled_calls), so every call has one version: call 1 the old one,
    calls 2-4 the new one; the episode spans two versions and its sample's token_versions say so."""
    from titanrl.models.hf_checkpoint import hf_state_dict, load_model
    from titanrl.rollout.agent_runner import AgentRunner

    model, _ = load_model(vllm_tiny_checkpoint)
    state = hf_state_dict(model)
    start = vllm_engine.policy_version
    runner = AgentRunner(vllm_engine, _config(vllm_tiny_checkpoint, on_weight_update), 0)
    try:
        group = asyncio.run(_episode_with_a_push_mid_call(runner, vllm_engine, state, start + 1))
    finally:
        vllm_engine.update_weights(state, start)  # the shared engine goes back to where it was
        runner.close()
    first = next(s for s in group.samples if s.stats.get("agent_episode") == 1.0)
    assert first.stats["agent_calls"] == 4
    assert first.stats["agent_resampled_calls"] >= 1
    assert first.stats["agent_versions_spanned"] == 2
    # Each call prompts the same ids, so each is its own sample, in call order.
    call_versions = [{v for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m} for s in group.samples]
    assert call_versions == [{start}, {start + 1}, {start + 1}, {start + 1}]


async def _one_call(base_url, api_key, row):
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.completions.create(model="policy", prompt=[5, 6, 7, 8], max_tokens=4)
    return 1.0


def test_an_engine_failure_inside_a_call_fails_the_worker_not_just_the_episode(vllm_engine, vllm_tiny_checkpoint,
                                                                              monkeypatch):
    """The agent only sees an HTTP 500 when the engine fails under its call; the runner re-raises the
    engine's error (as an environment episode's engine errors propagate), so the worker fails and is
    replaced instead of scoring every later episode as a reward error."""
    from titanrl.rollout.agent_runner import AgentRunner
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    async def failing(generator, prompt, **kwargs):
        raise RuntimeError("the engine died")

    monkeypatch.setattr(AsyncGenerator, "generate_n", failing)
    config = _config(vllm_tiny_checkpoint, "continue")
    config.agent.fn = _one_call
    runner = AgentRunner(vllm_engine, config, 0)
    try:
        with pytest.raises(RuntimeError, match="the engine died"):
            runner.generate([{"prompt": "x"}], seed=1, first_group_id=0)
    finally:
        runner.close()
