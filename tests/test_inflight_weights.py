"""In-flight weight updates on the real vLLM engine (`AsyncGenerator.update_weights`).

New weights land between two engine steps while a request is running. With the default
('continue'), the request keeps its tokens, every token records the version that sampled it,
and vLLM recomputes the KV cache with the new weights: the logprobs after the switch are the
new model's on the whole sequence, not a mix with stale keys and values. With 'regenerate'
the request is aborted and its caller told to start over.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm")

from titanrl.models.hf_checkpoint import hf_state_dict, load_model, load_state_dict_into  # noqa: E402
from titanrl.rollout.vllm.async_engine import AsyncGenerator, WeightsChanged  # noqa: E402

TOL = 1e-5
PROMPT = [5, 6, 7, 8]


def _our_logprobs(model, seq: list[int]) -> torch.Tensor:
    """The trainer's log p(token t+1 | tokens <= t) at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([seq]))[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]


async def _generate_with_update(engine, new_state, version: int, after_tokens: int, regenerate: bool = False):
    """One 40-token request; `new_state` is pushed once it has `after_tokens` tokens."""
    async with AsyncGenerator(engine) as gen:
        request = asyncio.ensure_future(gen.generate(PROMPT, temperature=1.0, max_tokens=40, seed=11))
        while max((await gen.running_tokens()).values(), default=0) < after_tokens:
            await asyncio.sleep(0)
        await gen.update_weights(new_state, version, regenerate=regenerate)
        return await request


def _models(checkpoint):
    old_model, _ = load_model(checkpoint)
    old_state = hf_state_dict(old_model)
    gen = torch.Generator().manual_seed(4)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old_state.items()}
    new_model, _ = load_model(checkpoint)
    load_state_dict_into(new_model, new_state)
    return old_model, old_state, new_model, new_state


def test_update_mid_request_keeps_tokens_and_recomputes_kv_with_new_weights(vllm_engine, vllm_tiny_checkpoint):
    """A push after 10 tokens: those tokens equal an undisturbed request's (same seed) and carry the
    old version with the old model's logprobs; every later token carries the new version, and its
    logprob is the new model's over the whole sequence (<= 1e-5), which differs from the old model's
    (> 1e-3): the KV cache of the first tokens was recomputed, not reused stale."""
    old_model, old_state, new_model, new_state = _models(vllm_tiny_checkpoint)
    start = vllm_engine.policy_version
    undisturbed = asyncio.run(_run_plain(vllm_engine))
    try:
        c = asyncio.run(_generate_with_update(vllm_engine, new_state, start + 1, after_tokens=10))
    finally:
        vllm_engine.update_weights(old_state, start)  # the shared engine goes back to where it was
    k = c.token_versions.index(start + 1)
    assert 10 <= k < len(c.token_ids) == 40
    assert c.token_versions == [start] * k + [start + 1] * (40 - k)
    assert c.policy_version == start
    assert c.token_ids[:k] == undisturbed.token_ids[:k]
    seq = c.prompt_token_ids + c.token_ids
    p = len(c.prompt_token_ids) - 1
    generated = torch.tensor(c.logprobs)
    old_lp, new_lp = _our_logprobs(old_model, seq)[p:], _our_logprobs(new_model, seq)[p:]
    assert (generated[:k] - old_lp[:k]).abs().max().item() <= TOL
    assert (generated[k:] - new_lp[k:]).abs().max().item() <= TOL
    assert (old_lp[k:] - new_lp[k:]).abs().max().item() > 1e-3


async def _run_plain(engine):
    async with AsyncGenerator(engine) as gen:
        return await gen.generate(PROMPT, temperature=1.0, max_tokens=40, seed=11)


def test_regenerate_aborts_running_requests(vllm_engine, vllm_tiny_checkpoint):
    """With regenerate=True the running request is aborted and its caller gets WeightsChanged; the
    engine then serves new requests with the new weights only."""
    _, old_state, _, new_state = _models(vllm_tiny_checkpoint)
    start = vllm_engine.policy_version
    try:
        with pytest.raises(WeightsChanged):
            asyncio.run(_generate_with_update(vllm_engine, new_state, start + 1, after_tokens=5, regenerate=True))
        after = asyncio.run(_run_plain(vllm_engine))
        assert set(after.token_versions) == {start + 1}
    finally:
        vllm_engine.update_weights(old_state, start)  # the shared engine goes back to where it was


async def _deferred_update(engine, new_state, version: int, waiting_requests: int):
    """One 40-token request on a generator with `defer_loads`; after 10 tokens `new_state` is
    pushed while `waiting_requests` requests (0: none) wait for `version`. Returns the completion
    and whether the load had landed before the request finished."""
    async with AsyncGenerator(engine, defer_loads=True) as gen:
        request = asyncio.ensure_future(gen.generate(PROMPT, temperature=1.0, max_tokens=40, seed=11))
        while max((await gen.running_tokens()).values(), default=0) < 10:
            await asyncio.sleep(0)
        waiter = asyncio.ensure_future(gen.wait_for_version(version, requests=waiting_requests)) \
            if waiting_requests else None
        await asyncio.sleep(0)  # the waiter registers
        await asyncio.wait_for(gen.update_weights(new_state, version), timeout=60)
        landed_first = not request.done()
        if waiter is not None:
            await waiter
        return await request, landed_first


def test_a_deferred_load_waits_while_it_would_only_recompute(vllm_engine, vllm_tiny_checkpoint):
    """With `defer_loads` and nobody waiting for the new weights, a load mid-request waits until the
    request is done (it would recompute its KV cache and let nothing start): every token keeps the
    old version, and the engine holds the new one afterwards."""
    _, old_state, _, new_state = _models(vllm_tiny_checkpoint)
    start = vllm_engine.policy_version
    try:
        c, landed_first = asyncio.run(_deferred_update(vllm_engine, new_state, start + 1, waiting_requests=0))
        assert not landed_first
        assert len(c.token_ids) == 40 and c.token_versions == [start] * 40
        assert vllm_engine.policy_version == start + 1
    finally:
        vllm_engine.update_weights(old_state, start)


def test_a_deferred_load_lands_at_once_when_it_lets_waiting_requests_start(vllm_engine, vllm_tiny_checkpoint):
    """With `defer_loads`, a request waiting for the new weights and a free sequence slot make the
    load worth its recompute of the one running request: it lands mid-request, as without deferral."""
    _, old_state, _, new_state = _models(vllm_tiny_checkpoint)
    start = vllm_engine.policy_version
    try:
        c, landed_first = asyncio.run(_deferred_update(vllm_engine, new_state, start + 1, waiting_requests=1))
        assert landed_first
        k = c.token_versions.index(start + 1)
        assert 10 <= k < 40 and c.token_versions == [start] * k + [start + 1] * (40 - k)
    finally:
        vllm_engine.update_weights(old_state, start)


def test_a_deferred_load_goes_on_when_the_engine_step_fails(vllm_engine, vllm_tiny_checkpoint, monkeypatch):
    """A load deferred behind a running request does not wait forever for steps that will never
    come once the engine's step fails: it lands, and the request gets the engine's error."""
    _, old_state, _, new_state = _models(vllm_tiny_checkpoint)
    start = vllm_engine.policy_version
    llm_engine = vllm_engine.llm.llm_engine

    def broken_step():
        raise RuntimeError("engine step failed")

    async def run():
        gen = AsyncGenerator(vllm_engine, defer_loads=True)
        await gen.__aenter__()
        request = asyncio.ensure_future(gen.generate(PROMPT, temperature=1.0, max_tokens=200, seed=11))
        while not await gen.running_tokens():
            await asyncio.sleep(0)
        load = asyncio.ensure_future(gen.update_weights(new_state, start + 1))
        await asyncio.sleep(0.05)
        deferred = not load.done()
        monkeypatch.setattr(llm_engine, "step", broken_step)
        await asyncio.wait_for(load, timeout=60)  # a regression is a failure, not a hung suite
        with pytest.raises(RuntimeError, match="engine step failed"):
            await request
        with pytest.raises(RuntimeError, match="engine step failed"):
            await gen.__aexit__(None, None, None)
        return deferred

    try:
        assert asyncio.run(run())
        assert vllm_engine.policy_version == start + 1
    finally:
        monkeypatch.undo()
        vllm_engine.update_weights(old_state, start)


def test_a_failing_engine_step_fails_waiting_requests_instead_of_hanging(vllm_engine, monkeypatch):
    """When the engine's step raises (vLLM state torn down, a worker error), every request awaiting a
    completion gets that error: without it their futures stay pending and the run hangs forever."""
    llm_engine = vllm_engine.llm.llm_engine

    def broken_step():
        raise RuntimeError("engine step failed")

    async def run():
        results = None
        with pytest.raises(RuntimeError, match="engine step failed"):  # leaving the block re-raises it
            async with AsyncGenerator(vllm_engine) as gen:
                monkeypatch.setattr(llm_engine, "step", broken_step)
                requests = [gen.generate(PROMPT, temperature=1.0, max_tokens=8, seed=i) for i in range(2)]
                # A bound keeps a regression a failure, not a hung suite.
                results = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), timeout=60)
        return results

    results = asyncio.run(run())
    monkeypatch.undo()
    assert [str(r) for r in results] == ["engine step failed"] * 2
    assert asyncio.run(_run_plain(vllm_engine)).token_ids  # the engine itself still serves


def test_versions_expand_at_the_token_counts_the_loads_saw():
    """Pure bookkeeping: tokens before a load's count keep the older version, later ones the loaded
    one, whatever order the changes were recorded in; a request never stepped has no tokens."""
    from titanrl.rollout.vllm.async_engine import _Versions

    versions = _Versions()
    assert versions.expand(3) == []
    versions.first = 4
    assert versions.expand(3) == [4, 4, 4]
    versions.changes += [(5, 6), (2, 5)]
    assert versions.expand(7) == [4, 4, 5, 5, 5, 6, 6]
    assert versions.expand(4) == [4, 4, 5, 5]  # a load after the request's last token changes nothing


def test_engine_builds_outputs_only_for_finished_requests(vllm_engine, monkeypatch):
    """Requests ask for their final output only (FINAL_ONLY, as LLM.generate does): no step hands
    back a RequestOutput of a running request, which would cost the engine's thread a copy of its
    tokens and logprobs per running request per step."""
    llm_engine = vllm_engine.llm.llm_engine
    step, seen = llm_engine.step, []

    def recording_step():
        outputs = step()
        seen.extend(outputs)
        return outputs

    async def run():
        async with AsyncGenerator(vllm_engine) as gen:
            monkeypatch.setattr(llm_engine, "step", recording_step)
            return await asyncio.gather(*(gen.generate(PROMPT, temperature=1.0, max_tokens=12, seed=i)
                                          for i in range(4)))

    completions = asyncio.run(run())
    monkeypatch.undo()
    assert len(seen) == 4 and all(o.finished for o in seen)
    assert all(len(c.token_versions) == len(c.token_ids) > 0 for c in completions)


def test_the_engine_steps_while_the_loop_hands_finished_requests_back(vllm_engine, monkeypatch):
    """The next step starts before the loop hands a step's finished requests back: while the loop
    is busy with a finished request (here blocked for 0.3 s, as scoring and streaming a group keep it
    busy), the engine's thread is stepping the requests still running."""
    import threading
    import time

    llm_engine = vllm_engine.llm.llm_engine
    step, intervals = llm_engine.step, []

    def slow_step():  # slow enough that a step started before the block is still running in it
        start = time.perf_counter()
        time.sleep(0.05)
        outputs = step()
        intervals.append((start, time.perf_counter(), threading.current_thread().name))
        return outputs

    async def run():
        async with AsyncGenerator(vllm_engine) as gen:
            monkeypatch.setattr(llm_engine, "step", slow_step)
            short = gen.generate(PROMPT, temperature=1.0, max_tokens=2, seed=1)
            long = asyncio.ensure_future(gen.generate(PROMPT, temperature=1.0, max_tokens=30, seed=2))
            await short
            blocked_from = time.perf_counter()
            time.sleep(0.3)  # the loop busy with the finished request
            blocked = (blocked_from, time.perf_counter())
            return blocked, await long

    (blocked_from, blocked_to), long = asyncio.run(run())
    monkeypatch.undo()
    assert len(long.token_ids) == 30
    during = [i for i in intervals if i[0] < blocked_to and i[1] > blocked_from]
    assert during, f"no engine step ran while the loop was busy: {intervals} vs {(blocked_from, blocked_to)}"
    assert all(name.startswith("titanrl-engine") for _, _, name in intervals)


def test_generate_n_is_n_seeded_requests_and_each_sample_records_its_own_versions(vllm_engine, vllm_tiny_checkpoint):
    """`generate_n(n=3, seed=s)` (one request vLLM fans out) samples what three requests seeded
    s, s+1, s+2 sample; a push after 10 tokens is recorded in every sample's token versions."""
    _, old_state, _, new_state = _models(vllm_tiny_checkpoint)
    start = vllm_engine.policy_version
    sampling = dict(temperature=1.0, max_tokens=30)

    async def separate_and_together():
        async with AsyncGenerator(vllm_engine) as gen:
            separate = await asyncio.gather(*(gen.generate(PROMPT, seed=20 + i, **sampling) for i in range(3)))
            together = await gen.generate_n(PROMPT, n=3, seed=20, **sampling)
        return separate, together

    async def with_update():
        async with AsyncGenerator(vllm_engine) as gen:
            request = asyncio.ensure_future(gen.generate_n(PROMPT, n=3, seed=20, **sampling))
            while min((await gen.running_tokens()).values(), default=0) < 10:
                await asyncio.sleep(0)
            await gen.update_weights(new_state, start + 1)
            return await request

    separate, together = asyncio.run(separate_and_together())
    try:
        updated = asyncio.run(with_update())
    finally:
        vllm_engine.update_weights(old_state, start)
    assert [c.token_ids for c in together] == [c.token_ids for c in separate]
    assert len({tuple(c.token_ids) for c in together}) == 3  # three seeds, three samples
    for c in updated:
        k = c.token_versions.index(start + 1)
        assert 10 <= k < len(c.token_ids) == 30
        assert c.token_versions == [start] * k + [start + 1] * (30 - k)


def test_the_engine_thread_computes_with_the_callers_intra_op_thread_count(vllm_engine):
    """OpenMP keeps the thread count per thread: the engine's thread must use the count of the
    thread that entered the generator (the worker's `threads_per_worker`), not OMP_NUM_THREADS
    (vLLM's CPU attention fails a step whose count differs from the one it planned with)."""
    from titanrl.rollout.vllm.engine import use_intra_op_threads

    before = torch.get_num_threads()
    wanted = before + 1  # differs from OMP_NUM_THREADS, which a new thread would start at

    async def run():
        use_intra_op_threads(wanted)
        async with AsyncGenerator(vllm_engine) as gen:
            # A step first: vLLM's attention plans with the thread's OpenMP count before any
            # torch op could bring the thread to torch's count.
            completion = await gen.generate(PROMPT, temperature=1.0, max_tokens=3, seed=1)
            seen = await gen.on_engine(torch.get_num_threads)
        return seen, completion

    try:
        seen, completion = asyncio.run(run())
    finally:
        use_intra_op_threads(before)
    assert seen == wanted
    assert len(completion.token_ids) == 3
