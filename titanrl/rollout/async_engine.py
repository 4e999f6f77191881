"""An asyncio front end to a running VllmEngine: many concurrent single-turn requests.

Multi-turn episodes interleave generation with environment work (sandboxed code, tools).
`AsyncGenerator.generate` lets each episode await its own turn while a pump task steps
vLLM's engine with whatever requests are pending, so continuous batching keeps running
for every other episode while one waits on a slow tool call. The pump yields to the event
loop between engine steps; sandbox subprocesses progress in their own processes meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from titanrl.rollout.vllm_engine import Completion, VllmEngine


class AsyncGenerator:
    """Owns the engine's request queue while `run()` is active (one event loop at a time)."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future[Completion]] = {}
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncGenerator:
        self._pump = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._pump is not None
        self._pump.cancel()
        try:
            await self._pump
        except asyncio.CancelledError:
            pass
        if self._pending:  # an episode failed mid-turn: free the engine for the next batch
            self.engine.llm.llm_engine.abort_request(list(self._pending))
            self._pending.clear()

    async def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        temperature: float,
        top_p: float = 1.0,
        max_tokens: int,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] | None = None,
    ) -> Completion:
        """One completion of `prompt_ids`; the text of a matched stop string stays in the output."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._pump is None or self._pump.done():
            raise RuntimeError("AsyncGenerator.generate needs `async with AsyncGenerator(engine):`")
        request_id = f"titanrl-{next(self._ids)}"
        params = SamplingParams(
            n=1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop=list(stop) or None,
            include_stop_str_in_output=True,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            logprobs=0,
        )
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self.engine.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)
        self._wake.set()
        return await future

    async def _run(self) -> None:
        llm_engine = self.engine.llm.llm_engine
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            for output in llm_engine.step():
                if not output.finished:
                    continue
                future = self._pending.pop(output.request_id, None)
                if future is not None and not future.done():
                    future.set_result(self._completion(output))
            # Let episodes whose tools finished queue their next turn before the next step.
            await asyncio.sleep(0)

    def _completion(self, output) -> Completion:
        c = output.outputs[0]
        ids = list(c.token_ids)
        return Completion(
            prompt_token_ids=list(output.prompt_token_ids or []),
            token_ids=ids,
            text=c.text,
            logprobs=[float(pos[t].logprob) for pos, t in zip(c.logprobs or [], ids, strict=False)],
            finish_reason=c.finish_reason,
            policy_version=self.engine.policy_version,
        )
