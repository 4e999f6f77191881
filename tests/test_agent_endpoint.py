"""The rollout worker's OpenAI-compatible endpoint, driven by the real `openai` client (and raw
httpx for malformed requests) against a real in-process worker: the tool agent's trained warm
start on vLLM, batch-invariant, with the bubblewrap sandbox (examples/openai_agent).

The agent function of the run is `_dispatch`, which plays whichever harness a test installs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

from titanrl.cli import load_config_file
from titanrl.config.resolve import resolve

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"
ROWS = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a, b in ((347, 829), (512, 304), (199, 777))]
_HARNESS: list = []


async def _dispatch(base_url: str, api_key: str, row: dict) -> float:
    return await _HARNESS[0](base_url, api_key, row)


@pytest.fixture(scope="module")
def worker():
    """One in-process RolloutWorker of the example's config (4 sequences' KV, groups of 2), whose
    agent is `_dispatch`."""
    from titanrl.rollout.worker import RolloutWorker

    config = load_config_file(str(EXAMPLE / "config.py"))
    rollout = dataclasses.replace(config.rollout, group_size=2,
                                  engine=dataclasses.replace(config.rollout.engine, max_num_seqs=32))
    agent = dataclasses.replace(config.agent, fn=_dispatch, max_request_bytes=20_000)
    config = dataclasses.replace(config, rollout=rollout, agent=agent, batch_invariant=True)
    worker = RolloutWorker(0, resolve(config))
    worker.config = config
    yield worker
    worker.close()
    sys.path.remove(str(EXAMPLE))


def _play(worker, harness, rows=ROWS, seed=11):
    _HARNESS[:] = [harness]
    return worker.generate(rows, seed=seed, first_group_id=0)


def _agent_module():
    import agent  # examples/openai_agent/agent.py (load_config_file put its folder on sys.path)

    return agent


@pytest.mark.own_vllm_engine
def test_bad_requests_get_openai_errors_naming_the_field_and_the_worker_keeps_serving(worker):
    """Missing or wrong tokens get 401, a finished episode's key 401, malformed bodies 400 naming
    the field, an unknown model 404, an oversized body 413, sampling settings the trainer would not
    score 400; a valid call afterwards is served."""
    seen: dict[str, tuple[int, dict]] = {}

    async def harness(base_url, api_key, row):
        ok = {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}], "max_tokens": 4}
        token = api_key.rpartition(".")[0]
        cases = {
            "no token": ({}, ok),
            "wrong token": ({"Authorization": "Bearer nope.ep0"}, ok),
            "finished episode": ({"Authorization": f"Bearer {token}.ep999999"}, ok),
            "not json": ({}, b"{not json"),
            "no messages": ({}, {"model": "policy"}),
            "unknown field": ({}, {**ok, "frequency_penalty": 0.5}),
            "unknown model": ({}, {**ok, "model": "gpt-4o"}),
            "too large": ({}, {**ok, "messages": [{"role": "user", "content": "x" * 30_000}]}),
            "temperature": ({}, {**ok, "temperature": 0.3}),
            "max_tokens": ({}, {**ok, "max_tokens": 100_000}),
            "n": ({}, {**ok, "n": 0}),
            "stream": ({}, {**ok, "stream": True}),
            "role": ({}, {**ok, "messages": [{"content": "hi"}]}),
        }
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            for name, (headers, body) in cases.items():
                headers = {"Authorization": f"Bearer {api_key}", **headers} if name not in ("no token",) else {}
                if name in ("wrong token", "finished episode"):
                    headers = dict(cases[name][0])
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await http.post("/chat/completions", content=content,
                                    headers={**headers, "Content-Type": "application/json"})
                seen[name] = (r.status_code, r.json()["error"])
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        reply = await client.chat.completions.create(model="policy", messages=ok["messages"], max_tokens=4)
        seen["valid"] = (200, {"content": reply.choices[0].message.content})
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0).chat.completions.create(
                model="policy", messages=ok["messages"])
        return 1.0

    batch = _play(worker, harness, rows=ROWS[:1])
    assert batch.groups[0].samples[0].reward_error is None
    status = {name: code for name, (code, _) in seen.items()}
    assert status == {"no token": 401, "wrong token": 401, "finished episode": 401, "not json": 400,
                      "no messages": 400, "unknown field": 400, "unknown model": 404, "too large": 413,
                      "temperature": 400, "max_tokens": 400, "n": 400, "stream": 400, "role": 400, "valid": 200}
    params = {name: error.get("param") for name, (code, error) in seen.items() if code == 400}
    assert params == {"not json": None, "no messages": "messages", "unknown field": "frequency_penalty",
                      "temperature": "temperature", "max_tokens": "max_tokens", "n": "n", "stream": "stream",
                      "role": "messages[0].role"}
    assert seen["unknown model"][1]["param"] == "model" and "policy" in seen["unknown model"][1]["message"]
    assert seen["finished episode"][1]["code"] == "episode_closed"
    assert "agent.max_request_bytes" in seen["too large"][1]["message"]
    assert "rollout.sampling.temperature" in seen["temperature"][1]["message"]
    assert isinstance(seen["valid"][1]["content"], str)


class _Recorder:
    """Records what `AsyncGenerator.generate_n` returned to the endpoint (the engine's own ids)."""

    def __init__(self, monkeypatch):
        from titanrl.rollout.vllm.async_engine import AsyncGenerator

        self.calls: list = []
        original = AsyncGenerator.generate_n

        async def recording(generator, prompt, **kwargs):
            completions = await original(generator, prompt, **kwargs)
            self.calls += [(list(prompt), c) for c in completions]
            return completions

        monkeypatch.setattr(AsyncGenerator, "generate_n", recording)


async def _three_calls(base_url, api_key, row):
    """Exactly three calls: a tool call gets the sandbox's output back, an answer gets asked again."""
    agent = _agent_module()
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=agent.TOOLS,
                                                     max_tokens=agent.MAX_TOKENS, stop=["</tool_call>"])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                output, _ = await agent.run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        else:
            messages.append({"role": "user", "content": "Are you sure? " + row["prompt"]})
    return 1.0


@pytest.mark.own_vllm_engine
def test_a_three_call_episode_is_one_sample_of_exactly_the_ids_the_engine_sampled(worker, monkeypatch):
    """Each episode's three calls extend each other, so the episode is one sample; its model tokens
    (mask 1) are, in order and at their positions, exactly the token ids the engine sampled for
    the three calls, with the engine's logprobs, and each call's prompt is exactly the sample's
    tokens before that call's completion."""
    recorder = _Recorder(monkeypatch)
    batch = _play(worker, _three_calls)
    samples = [s for g in batch.groups for s in g.samples]
    assert len(samples) == len(ROWS) * 2 and all(s.reward_error is None for s in samples)
    for s in samples:
        assert s.stats["agent_calls"] == 3 and s.stats["agent_prefix_breaks"] == 0
        sequence = s.prompt_ids + s.completion_ids
        calls = sorted((c for c in recorder.calls
                        if sequence[:len(c[0]) + len(c[1].token_ids)] == c[0] + c[1].token_ids
                        and c[0][:len(s.prompt_ids)] == s.prompt_ids), key=lambda c: len(c[0]))
        calls = list({len(p): (p, c) for p, c in calls}.values())  # identical sibling episodes record twice
        assert len(calls) == 3
        model_positions = [i for i, m in enumerate(s.loss_mask) if m]
        expected_positions = [len(p) - len(s.prompt_ids) + k for p, c in calls for k in range(len(c.token_ids))]
        assert model_positions == expected_positions
        assert [s.completion_ids[i] for i in model_positions] == [t for _, c in calls for t in c.token_ids]
        assert [s.gen_logprobs[i] for i in model_positions] == [lp for _, c in calls for lp in c.logprobs]
        assert calls[0][0] == s.prompt_ids


@pytest.mark.own_vllm_engine
def test_a_harness_that_re_renders_history_gets_one_sample_per_call(worker, monkeypatch):
    """A harness that rewrites the model's earlier replies (here: adds a space to each) sends prompts
    that do not extend what was sampled: every call becomes its own sample, exactly the engine's
    prompt and completion, and the breaks are counted. (With the prefix check off, the runner
    would splice the calls into one sample: `check_prefix=False` makes this test fail.)"""
    recorder = _Recorder(monkeypatch)

    async def re_rendering(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
            messages += [{"role": "assistant", "content": (reply.choices[0].message.content or "") + " "},
                         {"role": "user", "content": "Again: " + row["prompt"]}]
        return 0.5

    batch = _play(worker, re_rendering)
    engine_sequences = [p + c.token_ids for p, c in recorder.calls]
    for group in batch.groups:
        assert len(group.samples) == 2 * 3
        for s in group.samples:
            assert s.prompt_ids + s.completion_ids in engine_sequences
            assert s.loss_mask == [1] * len(s.completion_ids)
            assert s.reward == 0.5
        firsts = [s for s in group.samples if s.stats.get("agent_episode") == 1.0]
        assert len(firsts) == 2 and all(s.stats["agent_prefix_breaks"] == 2 for s in firsts)


@pytest.mark.own_vllm_engine
def test_an_agent_that_raises_or_times_out_is_a_contained_error_and_its_late_calls_are_refused(worker):
    """An agent raising costs its episode scoring.error_value with the error named; one running past
    agent.timeout_s too, and a call it makes after that is refused with 401."""
    late: list = []

    async def raising(base_url, api_key, row):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2)
        raise ValueError("the harness broke")

    async def slow(base_url, api_key, row):
        async def after_timeout():
            await asyncio.sleep(1.5)
            try:
                await openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                late.append("served")
            except openai.AuthenticationError as e:
                late.append(e.code)

        late.append(asyncio.get_running_loop().create_task(after_timeout()))
        await asyncio.sleep(30)
        return 1.0

    batch = _play(worker, raising, rows=ROWS[:1])
    for s in batch.groups[0].samples:
        assert s.reward == worker.config.scoring.error_value
        assert s.reward_error == "agent raised ValueError: the harness broke"
        assert len(s.completion_ids) > 0  # the call it made is still recorded
    runner = worker.episodes
    runner.cfg = dataclasses.replace(runner.cfg, timeout_s=1.0)
    try:
        _HARNESS[:] = [slow]
        outcome = runner.loop.run_until_complete(_slow_episode(runner, late))
    finally:
        runner.cfg = worker.config.agent
    assert outcome.error == "agent timed out after agent.timeout_s=1 s"
    assert late[1:] == ["episode_closed"]


async def _slow_episode(runner, late):
    """One training episode on the runner's loop; returns once the late call has been answered."""
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    async with AsyncGenerator(runner.engine) as generator:
        (outcome,) = await runner._episodes([ROWS[0]], 1, False, 5, generator)
        await late[0]
    return outcome


@pytest.mark.own_vllm_engine
def test_a_sync_agent_with_the_sync_client_runs_in_a_thread(worker):
    """agent.fn may be a plain function using `openai.OpenAI`: it runs in the runner's threads while
    the loop serves its calls."""
    from titanrl.rollout.agent_runner import AgentRunner

    def sync_agent(base_url, api_key, row):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        reply = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=3, logprobs=0)
        assert len(reply.choices[0].logprobs.token_logprobs) == reply.usage.completion_tokens
        return 0.25

    config = dataclasses.replace(worker.config, agent=dataclasses.replace(worker.config.agent, fn=sync_agent))
    runner = AgentRunner(worker.engine, config, 0)
    try:
        batch = runner.generate(ROWS[:2], seed=3, first_group_id=0)
    finally:
        runner.close()
    samples = [s for g in batch.groups for s in g.samples]
    assert [s.reward for s in samples] == [0.25] * 4 and all(s.reward_error is None for s in samples)
    assert all(s.stats["agent_calls"] == 1 and 1 <= len(s.completion_ids) <= 3 for s in samples)


@pytest.mark.own_vllm_engine
def test_endpoint_episodes_train_on_model_tokens_only_with_exact_parity(worker):
    """The example agent's episodes (tool calls run in the sandbox) through the endpoint: inserted
    tokens (tool outputs, turn markers) get zero loss gradient, every model token a gradient, and in
    batch-invariant mode the trainer's recomputed logprobs equal the engine's: parity 0.0."""
    from support.episode_tokens import check_training_tokens
    from transformers import AutoTokenizer

    from titanrl.config import MemoryConfig, TrainConfig
    from titanrl.trainer.setup import TrainerSetup
    from titanrl.trainer.trainer import GRPOTrainer

    agent = _agent_module()
    rows = [json.loads(line) for line in (EXAMPLE.parent / "tool_agent" / "data" / "eval.jsonl").read_text().splitlines()]
    batch = _play(worker, agent.agent, rows=rows[:8], seed=7)
    groups = batch.groups
    assert sum(s.stats.get("agent_prefix_breaks", 0) for g in groups for s in g.samples) == 0
    config = worker.config
    tokenizer = AutoTokenizer.from_pretrained(config.model.checkpoint)
    trainer = GRPOTrainer(TrainerSetup(config.model, TrainConfig(memory=MemoryConfig(micro_batch_size=8)),
                                       config.rollout.sampling.temperature, 0, batch_invariant=True))
    check_training_tokens(trainer, groups, tokenizer)
    metrics = trainer.step(groups)
    assert metrics["parity/tokens_checked"] == sum(sum(s.loss_mask) for g in groups for s in g.samples)
    assert metrics["parity/logprob_diff_max"] == 0.0
