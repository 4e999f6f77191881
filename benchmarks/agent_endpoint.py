"""What an agent's call through the rollout worker's OpenAI endpoint costs over a direct engine call, in one script.

A worker running `agent.fn` serves `/v1/completions` and `/v1/chat/completions` on 127.0.0.1
(FastAPI under uvicorn, `titanrl.agents.server`) from the same event loop and the same
`AsyncGenerator` as its engine's pump. This measures, on one tiny checkpoint
(`write_tiny_checkpoint(seed=3, std=0.1)`), one `VllmEngine` (max_model_len 256, max_num_seqs 32)
and one `AgentRunner` on it, the same engine work three ways, alternating in rounds:
  direct       `await generator.generate_n(prompt_ids, n=1, ...)`, K times one after another;
  completions  an agent episode (`AgentRunner.generate_group`) whose `openai.AsyncOpenAI` client
               (one per episode, max_retries=0) makes K `/v1/completions` calls with
               `prompt=<the same token ids>`;
  chat         the same with `/v1/chat/completions` and a fixed messages list, whose rendering
               under the chat template is the token ids the other two arms send.
Every arm sends the same prompt ids, max_tokens and per-call seeds, and asserts that it sampled
the same token ids (the runner's record of each endpoint call against the direct completions):
the engine work is identical, and the difference is the endpoint (HTTP, JSON, pydantic, the
client library, the episode's bookkeeping). Per-call times are taken around each call on the
caller's side (inside the agent for the endpoint arms).

Prints one JSON line per arm and setting:
  {"mode": "sequential", "arm": ..., "max_tokens": M, "per_call_ms_median": ..., "per_call_ms_mean": ...}
then one comparison line per setting:
  {"setting": "sequential_m1", "<arm>_overhead_ms_median": endpoint - direct, "<arm>_ratio_median": endpoint / direct,
   "<arm>_overhead_ms_paired_median": ..., "<arm>_ratio_total": ..., "<arm>_outside_engine_ms_median": ...,
   "identical_tokens": true, ...}
and, for concurrency (`--concurrency` episodes at once, each making K calls, against as many
direct callers each making K calls), one line per setting with the total wall time of each and
their ratio; then a summary line with the CPU (model name, whether /proc/cpuinfo lists avx512
flags, `cpu_flags`) and the torch / vLLM / openai / FastAPI / uvicorn versions. Settings:
`--max-tokens 1` (pure overhead: one engine step per call) and 32.

`_median` / `_mean` are of each arm's per-call times; `_paired_median` is the median over calls of
endpoint minus direct for the same round, call and seed (which sampled the same tokens, so it
leaves out how soon a stop token ends each call); `_ratio_total` is of the arms' summed times.
The overhead splits in two: `<arm>_outside_engine_ms_median`, an endpoint call's time less the
time its `generate_n` took inside it (HTTP, JSON, the openai client, the handler: what the
endpoint adds, whatever the engine does meanwhile), and `<arm>_engine_overhead_ms_paired_median`,
that `generate_n` against the direct call of the same tokens. The engine's step time drifts on a
shared 2-core VM by tens of percent within a minute, which swamps a few ms in the totals of long
calls (M=32): the outside-engine time is the number that does not move with it.

    python benchmarks/agent_endpoint.py [--rounds 10] [--calls 10] [--max-tokens 1,32] [--concurrency 16] [--out FILE]
    python benchmarks/agent_endpoint.py --smoke   # 1 round of 2 calls, 2 concurrent episodes: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer with the number only."},
    {"role": "user", "content": "What is 17 + 25?"},
]
"""The chat arm's conversation; its rendering is the prompt every arm sends."""
SERVED = "policy"
_CALL_TIMES: dict[str, list[float]] = {}
"""Per episode key (row["key"]), the wall time of each endpoint call, measured inside the agent."""


_CLIENTS: dict[str, Any] = {}
"""One `openai.AsyncOpenAI` per server, shared by the episodes (`with_options` gives each its key), as
examples/openai_agent does: a new client costs ~25 ms (its TLS context), which would be counted
against the endpoint in the concurrent arm."""


async def agent(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """The benchmark's agent: one `row["arm"]` call per seed in `row["seeds"]`, one after another."""
    import openai

    times = _CALL_TIMES.setdefault(row["key"], [])
    if base_url not in _CLIENTS:
        _CLIENTS[base_url] = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client = _CLIENTS[base_url].with_options(api_key=api_key)
    for seed in row["seeds"]:
        start = time.perf_counter()
        if row["arm"] == "chat":
            await client.chat.completions.create(model=SERVED, messages=row["messages"],
                                                 max_tokens=row["max_tokens"], seed=seed)
        else:
            await client.completions.create(model=SERVED, prompt=row["prompt_ids"],
                                            max_tokens=row["max_tokens"], seed=seed)
        times.append(time.perf_counter() - start)
    return 1.0


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class _Timed:
    """An episode's generator: the AsyncGenerator, with the time each `generate_n` call took (the
    engine's share of an endpoint call, as the handler awaits it)."""

    def __init__(self, generator: Any) -> None:
        self._generator, self.times = generator, []

    async def generate_n(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = await self._generator.generate_n(*args, **kwargs)
        self.times.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)


Calls = tuple[list[float], list[list[int]], list[float]]
"""Per call of an arm: its wall time, its sampled token ids and the time inside `generate_n`."""


class Bench:
    """The engine, the runner and its generator, and one method per arm."""

    def __init__(self, runner: Any, generator: Any, prompt_ids: list[int]) -> None:
        self.runner, self.generator, self.prompt_ids = runner, generator, prompt_ids
        s = runner.handler.settings
        # Exactly what the handler passes to generate_n for a call of these prompt ids.
        self.sampling = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.temperature > 0 else 0,
                             stop=[], stop_token_ids=s.stop_token_ids)
        self._keys = 0

    async def direct(self, max_tokens: int, seeds: list[int]) -> Calls:
        times, tokens = [], []
        for seed in seeds:
            start = time.perf_counter()
            (c,) = await self.generator.generate_n(self.prompt_ids, n=1, max_tokens=max_tokens, seed=seed,
                                                   **self.sampling)
            times.append(time.perf_counter() - start)
            assert c.prompt_token_ids == self.prompt_ids
            tokens.append(list(c.token_ids))
        return times, tokens, times

    async def endpoint(self, arm: str, max_tokens: int, seeds: list[int]) -> Calls:
        """One episode of `arm` (completions or chat): its calls' times (in the agent), the token ids the
        runner recorded and the time of each inside `generate_n`."""
        self._keys += 1
        key = f"{arm}-{self._keys}"
        row = {"prompt": "", "key": key, "arm": arm, "prompt_ids": self.prompt_ids, "messages": MESSAGES,
               "max_tokens": max_tokens, "seeds": seeds}
        timed = _Timed(self.generator)
        group = await self.runner.generate_group(row, 0, self._keys, timed)
        failed = [s.reward_error for s in group.samples if s.reward_error is not None]
        if failed:
            raise RuntimeError(f"the {arm} episode failed: {failed[0]}")
        # Each call's prompt is the same ids, so no call extends an earlier one: one sample per call, in order.
        assert len(group.samples) == len(seeds), (len(group.samples), len(seeds))
        assert all(s.prompt_ids == self.prompt_ids for s in group.samples), "the endpoint sampled another prompt"
        assert len(timed.times) == len(seeds), "a call was sampled again"
        return _CALL_TIMES.pop(key), [list(s.completion_ids) for s in group.samples], timed.times


def _arm_line(mode: str, arm: str, max_tokens: int, times: list[float], tokens: list[list[int]],
              engine: list[float]) -> dict[str, Any]:
    return {"benchmark": "agent_endpoint", "mode": mode, "arm": arm, "max_tokens": max_tokens, "calls": len(times),
            "per_call_ms_median": _ms(statistics.median(times)), "per_call_ms_mean": _ms(statistics.fmean(times)),
            "per_call_ms_min": _ms(min(times)), "per_call_ms_max": _ms(max(times)),
            "engine_ms_median": _ms(statistics.median(engine)), "engine_ms_mean": _ms(statistics.fmean(engine)),
            "completion_tokens_mean": round(statistics.fmean(len(t) for t in tokens), 2)}


async def sequential(bench: Bench, arms: list[str], max_tokens: int, rounds: int, calls: int) -> list[dict[str, Any]]:
    """`rounds` rounds of `calls` calls per arm, the arms' order rotating each round; the same seeds in every arm."""
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    tokens: dict[str, list[list[int]]] = {arm: [] for arm in arms}
    engine: dict[str, list[float]] = {arm: [] for arm in arms}
    load_start = os.getloadavg()[0]
    for r in range(rounds):
        seeds = [100_000 * max_tokens + 1_000 * r + i for i in range(calls)]
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for arm in order:
            t, ids, e = await (bench.direct(max_tokens, seeds) if arm == "direct"
                               else bench.endpoint(arm, max_tokens, seeds))
            times[arm] += t
            tokens[arm] += ids
            engine[arm] += e
    for arm in arms[1:]:
        if tokens[arm] != tokens["direct"]:
            differ = sum(a != b for a, b in zip(tokens[arm], tokens["direct"], strict=True))
            raise AssertionError(f"max_tokens={max_tokens}: {differ} of {len(tokens[arm])} {arm} calls sampled other "
                                 "tokens than the direct calls with the same prompt and seed")
    lines = [_arm_line("sequential", arm, max_tokens, times[arm], tokens[arm], engine[arm]) for arm in arms]
    for line in lines:
        print(json.dumps(line), flush=True)
    direct = lines[0]
    summary: dict[str, Any] = {"benchmark": "agent_endpoint", "setting": f"sequential_m{max_tokens}",
                               "mode": "sequential", "max_tokens": max_tokens, "rounds": rounds, "calls_per_round": calls,
                               "identical_tokens": True, "direct_ms_median": direct["per_call_ms_median"],
                               "direct_ms_mean": direct["per_call_ms_mean"]}
    for line in lines[1:]:
        arm = line["arm"]
        for stat in ("median", "mean"):
            summary[f"{arm}_ms_{stat}"] = line[f"per_call_ms_{stat}"]
            summary[f"{arm}_overhead_ms_{stat}"] = round(line[f"per_call_ms_{stat}"] - direct[f"per_call_ms_{stat}"], 3)
            summary[f"{arm}_ratio_{stat}"] = round(line[f"per_call_ms_{stat}"] / direct[f"per_call_ms_{stat}"], 3)
        # Call i of round r samples the same tokens in every arm: the difference of each such pair
        # leaves out what varies from call to call (how soon a stop token ends it).
        paired = [e - d for e, d in zip(times[arm], times["direct"], strict=True)]
        summary[f"{arm}_overhead_ms_paired_median"] = _ms(statistics.median(paired))
        summary[f"{arm}_ratio_total"] = round(sum(times[arm]) / sum(times["direct"]), 3)
        # The overhead's two parts: outside generate_n (HTTP, JSON, the client, the handler), and
        # generate_n itself taking longer than the direct call of the same tokens.
        summary[f"{arm}_outside_engine_ms_median"] = _ms(statistics.median(
            t - e for t, e in zip(times[arm], engine[arm], strict=True)))
        summary[f"{arm}_engine_overhead_ms_paired_median"] = _ms(statistics.median(
            e - d for e, d in zip(engine[arm], times["direct"], strict=True)))
    summary["loadavg_start"], summary["loadavg_end"] = round(load_start, 2), round(os.getloadavg()[0], 2)
    print(json.dumps(summary), flush=True)
    return [*lines, summary]


async def concurrent(bench: Bench, max_tokens: int, rounds: int, calls: int, width: int) -> list[dict[str, Any]]:
    """`width` direct callers at once against `width` completions episodes at once, each making
    `calls` calls one after another (caller j's call i gets the same seed in both); `rounds` rounds, alternating."""
    walls: dict[str, list[float]] = {"direct": [], "completions": []}
    load_start = os.getloadavg()[0]
    same = total = 0
    for r in range(rounds):
        seeds = [[200_000 * max_tokens + 10_000 * r + 100 * j + i for i in range(calls)] for j in range(width)]
        order = ["direct", "completions"] if r % 2 == 0 else ["completions", "direct"]
        got = {}
        for arm in order:
            start = time.perf_counter()
            if arm == "direct":
                results = await asyncio.gather(*(bench.direct(max_tokens, s) for s in seeds))
            else:
                results = await asyncio.gather(*(bench.endpoint("completions", max_tokens, s) for s in seeds))
            walls[arm].append(time.perf_counter() - start)
            got[arm] = [ids for _, caller, _ in results for ids in caller]
        # Batched with other requests the logits may differ in their last bits, so this is reported, not asserted.
        same += sum(a == b for a, b in zip(got["direct"], got["completions"], strict=True))
        total += len(got["direct"])
    direct, endpoint = statistics.median(walls["direct"]), statistics.median(walls["completions"])
    line = {"benchmark": "agent_endpoint", "setting": f"concurrent_m{max_tokens}", "mode": "concurrent",
            "max_tokens": max_tokens, "concurrency": width, "calls_per_caller": calls, "rounds": rounds,
            "direct_wall_s_median": round(direct, 4), "completions_wall_s_median": round(endpoint, 4),
            "completions_wall_ratio": round(endpoint / direct, 3),
            "direct_ms_per_call": _ms(direct / (width * calls)),
            "completions_ms_per_call": _ms(endpoint / (width * calls)),
            "completions_overhead_ms_per_call": _ms((endpoint - direct) / (width * calls)),
            "identical_tokens_fraction": round(same / total, 4),
            "loadavg_start": round(load_start, 2), "loadavg_end": round(os.getloadavg()[0], 2)}
    print(json.dumps(line), flush=True)
    return [line]


async def measure(engine: Any, config: Any, args: argparse.Namespace, arms: list[str]) -> list[dict[str, Any]]:
    from titanrl.chat import render_chat
    from titanrl.rollout.agent_runner import AgentRunner
    from titanrl.rollout.vllm.async_engine import AsyncGenerator

    runner = AgentRunner(engine, config, 0)
    tokenizer = runner.tokenizer
    # The chat arm's prompt as the handler renders and tokenizes it: every arm sends these ids.
    prompt_ids = tokenizer.encode(render_chat(tokenizer, MESSAGES, encoded_with_specials=False),
                                  add_special_tokens=False)
    assert len(prompt_ids) + max(args.max_tokens) <= config.rollout.engine.max_model_len
    records: list[dict[str, Any]] = []
    try:
        async with AsyncGenerator(engine) as generator:
            await runner.start()
            bench = Bench(runner, generator, prompt_ids)
            # Warm-up: the first episode (imports, the client's first connection) and the first direct call.
            await bench.direct(1, [0])
            for arm in arms[1:]:
                await bench.endpoint(arm, 1, [0])
            for max_tokens in args.max_tokens:
                records += await sequential(bench, arms, max_tokens, args.rounds, args.calls)
            if args.concurrency > 0:
                for max_tokens in args.max_tokens:
                    records += await concurrent(bench, max_tokens, args.concurrent_rounds, args.calls, args.concurrency)
            await runner.close_pool()
    finally:
        runner.close()
    for r in records:
        r["prompt_tokens"] = len(prompt_ids)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="sequential rounds (each arm once per round)")
    parser.add_argument("--calls", type=int, default=10, help="calls per arm per round (one episode's calls; "
                        "also each concurrent caller's)")
    parser.add_argument("--max-tokens", default="1,32", help="comma-separated completion lengths, one setting each")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent episodes / direct callers (0: skip)")
    parser.add_argument("--concurrent-rounds", type=int, default=3)
    parser.add_argument("--no-chat", action="store_true", help="leave out the /v1/chat/completions arm")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: 1 round of 2 calls, "
                        "2 concurrent episodes, 1 concurrent round (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps nothing: it refuses --out")
        args.rounds, args.calls, args.concurrency, args.concurrent_rounds = 1, 2, 2, 1
    args.max_tokens = [int(m) for m in args.max_tokens.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    import fastapi
    import openai
    import torch
    import uvicorn
    import vllm

    import titanrl
    from titanrl.config import EngineConfig
    from titanrl.kernels.cpu_build import cpu_model_name, has_avx512, isa_flags
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

    arms = ["direct", "completions"] + ([] if args.no_chat else ["chat"])
    load_start = os.getloadavg()[0]
    calls_per_episode = args.calls + 1
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agent-endpoint-") as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "ckpt", seed=3, std=0.1)
        engine_settings = EngineConfig(max_model_len=256, max_num_seqs=32)
        config = titanrl.RunConfig(
            model=titanrl.ModelConfig(checkpoint=str(checkpoint)),
            agent=titanrl.AgentConfig(fn=agent, max_calls=calls_per_episode, timeout_s=600.0, served_model_name=SERVED),
            rollout=titanrl.RolloutConfig(group_size=1, prompts_per_step=max(1, args.concurrency),
                                          sampling=titanrl.SamplingConfig(temperature=1.0, max_new_tokens=32),
                                          engine=engine_settings))
        engine = VllmEngine(VllmEngineConfig(checkpoint=str(checkpoint), settings=engine_settings))
        try:
            records = asyncio.run(measure(engine, config, args, arms))
        finally:
            engine.close()
    settings = {r["setting"]: r for r in records if "setting" in r}
    summary: dict[str, Any] = {
        "benchmark": "agent_endpoint", "summary": True, "smoke": args.smoke, "arms": arms,
        "rounds": args.rounds, "calls": args.calls, "concurrency": args.concurrency,
        "identical_tokens": all(r["identical_tokens"] for r in settings.values() if r["mode"] == "sequential"),
        "overhead_ms_median": {name: {arm: r[f"{arm}_overhead_ms_median"] for arm in arms[1:]}
                               for name, r in settings.items() if r["mode"] == "sequential"},
        "ratio_median": {name: {arm: r[f"{arm}_ratio_median"] for arm in arms[1:]}
                         for name, r in settings.items() if r["mode"] == "sequential"},
        "overhead_ms_paired_median": {name: {arm: r[f"{arm}_overhead_ms_paired_median"] for arm in arms[1:]}
                                      for name, r in settings.items() if r["mode"] == "sequential"},
        "ratio_total": {name: {arm: r[f"{arm}_ratio_total"] for arm in arms[1:]}
                        for name, r in settings.items() if r["mode"] == "sequential"},
        "outside_engine_ms_median": {name: {arm: r[f"{arm}_outside_engine_ms_median"] for arm in arms[1:]}
                                     for name, r in settings.items() if r["mode"] == "sequential"},
        "concurrent_wall_ratio": {name: r["completions_wall_ratio"] for name, r in settings.items()
                                  if r["mode"] == "concurrent"},
        "cpu": cpu_model_name(), "avx512": has_avx512(), "cpu_flags": isa_flags(), "cores": os.cpu_count(),
        "engine_threads": engine_settings.threads, "torch": torch.__version__, "vllm": vllm.__version__,
        "openai": openai.__version__, "fastapi": fastapi.__version__, "uvicorn": uvicorn.__version__,
        "python": platform.python_version(), "loadavg_start": round(load_start, 2),
        "loadavg_end": round(os.getloadavg()[0], 2),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write("\n".join(json.dumps(r) for r in [*records, summary]) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
