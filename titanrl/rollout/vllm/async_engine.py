"""An asyncio front end to a running VllmEngine: many concurrent single-turn requests.

Multi-turn episodes interleave generation with environment work (sandboxed code, tools).
`AsyncGenerator.generate` lets each episode await its own turn while a pump task steps
vLLM's engine with whatever requests are pending, so continuous batching keeps running
for every other episode while one waits on a slow tool call.

The engine is only ever touched from one thread of its own (`on_engine`): each step, with the
requests queued since the last one added first, and every weight load and abort, one after
another. So the event loop stays free while vLLM computes (torch releases the GIL): a finished
request's group is scored and handed back during the next step, not after it. When the pump
stepped vLLM on the loop itself, every hop of that hand-back (the group's gather, each reward
call's helper thread, the reply) waited for a whole engine step, about 0.5 s per batch on the
arithmetic example, which left the trainer idle in continuous runs. The pump keeps one step
ahead: it sends the next step to the engine's thread before handing the last one's finished
requests back, so the engine does not sit idle between two steps while the loop (which also
scores rewards and streams groups back) comes round to the pump again. That idle time was 16 %
of the engine thread's; continuous rollouts went from 0.84x lock-step's step time on the
arithmetic example to 0.88-0.96x (benchmarks/continuous_vs_lockstep.py). A group is one request
of n samples (`generate_n`), so the loop's work per group is one future and one hand-back.

Requests ask vLLM for their final output only (`RequestOutputKind.FINAL_ONLY`, as `LLM.generate`
does): a per-step output for every running request (512 on the arithmetic example) costs the
engine's thread a RequestOutput with copies of the tokens and logprobs so far, every step, and
nothing here needs them. Which policy version sampled each token is known without them: weights
change only between steps, so a load records how many tokens each running request has at that
moment (`_Versions`).

A load with requests running makes vLLM recompute their KV cache: one more prefill of every
running request (0.3-0.45 s on top of a 1 s batch of 512 requests on the arithmetic example,
whose completions are a few tokens). With `defer_loads` a load waits, between steps, until it is
worth that: until no request runs, or it lets at least as many requests that wait for the new
weights (`wait_for_version`) start in the engine's free sequence slots as it recomputes. A long
tail (a few stragglers, a step's groups waiting) still gets its weights at once; a full engine,
whose waiting requests could not start anyway, does not pay a recompute for them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the weight-version bookkeeping runs without loading torch and the engine module
    from titanrl.rollout.vllm.engine import Completion, VllmEngine

T = TypeVar("T")
StepResult = tuple[list[tuple[str, Any, Any]], int, list[Any], dict[str, Any]]
"""What `_step` returns: the requests it added, the policy version it ran under, its outputs and
the routing records of the requests it finished."""


class WeightsChanged(Exception):
    """Raised into the requests that `update_weights(..., regenerate=True)` aborted."""


class _Versions:
    """The policy versions that sampled one request's tokens, kept as the points where they change."""

    def __init__(self) -> None:
        self.first: int | None = None
        """The version of the step that started the request (None until that step has run)."""
        self.changes: list[tuple[int, int]] = []
        """(tokens sampled before the load, the loaded version), one per load while it ran."""

    def expand(self, num_tokens: int) -> list[int]:
        """One version per token: a token sampled after the i-th change's load has its version."""
        if self.first is None:  # never stepped (cannot finish so): nothing was sampled
            return []
        versions = [self.first] * num_tokens
        for start, version in sorted(self.changes):
            versions[start:] = [version] * (num_tokens - min(start, num_tokens))
        return versions


class AsyncGenerator:
    """Owns the engine's request queue while `async with` is active (one event loop at a time)."""

    def __init__(self, engine: VllmEngine, defer_loads: bool = False) -> None:
        """`defer_loads`: hold a load until recomputing the running requests costs no more than
        the waiting ones gain (module docstring; `rollout.defer_weight_loads`); False: every load
        lands between the next two steps."""
        self.engine = engine
        self.defer_loads = defer_loads
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Future[list[Completion]]] = {}
        self._versions: dict[str, list[_Versions]] = {}
        """Per running request, per sample of it, which policy versions sampled its tokens."""
        self._routing_keys: dict[str, str] = {}
        """Per running request, its routing record's key (when the engine records routing)."""
        self._decoded_at_finish: dict[str, Any] = {}
        """Per running request whose text is decoded once it finishes, its SamplingParams
        (`titanrl.rollout.vllm.detokenize`; the engine's thread reads them, the loop removes them)."""
        self._to_add: list[tuple[str, Any, Any]] = []
        """(request id, inputs, params) of requests not yet handed to the engine (the next step adds them)."""
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self._version_changed = asyncio.Condition()
        self._waiting: dict[int, int] = {}
        """Minimum version -> requests waiting for it (`wait_for_version` calls in progress)."""
        self._stepped = asyncio.Condition()
        """Notified after every step and whenever `_waiting` changes (deferred loads re-check)."""
        self._engine_thread: ThreadPoolExecutor | None = None
        self._in_flight: asyncio.Future[StepResult] | None = None
        """The step on the engine's thread while the pump hands the one before back (`_pump_steps`)."""

    async def __aenter__(self) -> AsyncGenerator:
        import torch

        from titanrl.rollout.vllm.engine import use_intra_op_threads

        # The engine's thread computes with this thread's intra-op thread count (`threads_per_worker`).
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="titanrl-engine", initializer=use_intra_op_threads,
                                                 initargs=(torch.get_num_threads(),))
        self._pump = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._pump is not None and self._engine_thread is not None
        self._pump.cancel()
        try:
            await self._pump  # re-raises the error that stopped a failed pump
        except asyncio.CancelledError:
            pass
        finally:
            try:
                if self._pending:  # an episode failed mid-turn: free the engine for the next batch
                    await self._abort()
            finally:
                self._engine_thread.shutdown(wait=True)  # a step still running ends first
                self._engine_thread = None

    async def on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` between two engine steps, on the engine's thread, after whatever runs there
        now (a step); inline when the pump is not running (no step can be either). Everything
        that touches the engine goes through here: steps, loads, aborts, weight transports."""
        if self._engine_thread is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    async def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        """One completion of `prompt` (text, tokenized by the engine, or token ids); the text of a
        matched stop string stays in the output. `sampling`: `generate_n`'s keywords."""
        (completion,) = await self.generate_n(prompt, n=1, **sampling)
        return completion

    async def generate_n(
        self,
        prompt: str | Sequence[int],
        *,
        n: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Completion]:
        """`n` completions of `prompt`, sample i seeded with `seed + i`, returned together once all
        have finished: one vLLM request that vLLM fans out into `n` (its parallel sampling gives
        child i that same seed), so a GRPO group costs one request's input processing, one future
        and one hand-back instead of `n`. With routing recorded, `n` requests: each sample's
        routing needs its own key."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from titanrl.rollout.vllm.detokenize import decodable_at_finish
        from titanrl.rollout.vllm.routing_record import ROUTING_KEY

        if self._pump is None or self._pump.done():
            raise RuntimeError("AsyncGenerator.generate needs `async with AsyncGenerator(engine):`")
        if n > 1 and self.engine.routing_layers:
            samples = await asyncio.gather(*(
                self.generate_n(prompt, n=1, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                seed=None if seed is None else seed + i, stop=stop, stop_token_ids=stop_token_ids)
                for i in range(n)
            ))
            return [completion for (completion,) in samples]
        request_id = f"titanrl-{next(self._ids)}"
        extra_args = None
        if self.engine.routing_layers:
            self._routing_keys[request_id] = self.engine.routing_key()
            extra_args = {ROUTING_KEY: self._routing_keys[request_id]}
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            seed=seed,
            stop=list(stop) or None,
            include_stop_str_in_output=True,
            stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
            logprobs=0,
            flat_logprobs=True,  # a few lists per request, not a dict and a Logprob per token
            detokenize=not decodable_at_finish(stop),  # decoded once it finishes, unless stop strings need the text
            extra_args=extra_args,
            output_kind=RequestOutputKind.FINAL_ONLY,  # the finished request only (module docstring)
            skip_clone=True,  # made for this request alone: vLLM need not deep-copy it
        )
        future: asyncio.Future[list[Completion]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._versions[request_id] = [_Versions() for _ in range(n)]
        if not params.detokenize:
            self._decoded_at_finish[request_id] = params
        inputs = {"prompt": prompt} if isinstance(prompt, str) else TokensPrompt(prompt_token_ids=list(prompt))
        self._to_add.append((request_id, inputs, params))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        try:
            await self._pump_steps()
        except asyncio.CancelledError:
            raise  # `__aexit__`: it aborts what is still pending
        except Exception as e:
            # Every waiting caller gets the engine's error: a pump that died silently would leave
            # their futures pending forever (a hung run, not a failed one).
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(e)
            # A deferred load waits for steps: with none to come, it goes on (`_worth_loading`
            # sees this task done by the time the woken load runs).
            await self._notify_stepped()
            raise
        finally:
            self.engine.activity.set(False)  # a stopped pump samples nothing

    async def _pump_steps(self) -> None:
        from titanrl.rollout.vllm.engine import Completion

        loop = asyncio.get_running_loop()
        try:
            while True:
                if self._in_flight is None:
                    if not self._pending:
                        self.engine.activity.set(False)
                        self._wake.clear()
                        await self._wake.wait()
                        continue
                    self.engine.activity.set(True)
                    self._in_flight = self._submit_step(loop)
                to_add, version, outputs, records = await self._in_flight
                finished = [o for o in outputs if o.finished]  # FINAL_ONLY: finished requests only
                # The next step starts before this one's outputs are handed back: the engine
                # computes while the loop scores rewards and streams groups back (module docstring).
                self._in_flight = self._submit_step(loop) if len(self._pending) > len(finished) else None
                for request_id, _, _ in to_add:
                    for versions in self._versions.get(request_id, ()):  # (not aborted meanwhile)
                        versions.first = version  # its first tokens came from this step
                for output in finished:
                    future = self._pending.pop(output.request_id, None)
                    versions = self._versions.pop(output.request_id, None)
                    key = self._routing_keys.pop(output.request_id, None)
                    self._decoded_at_finish.pop(output.request_id, None)
                    if future is not None and not future.done() and versions is not None:
                        completions = [Completion.of(output, sample, sample_versions.expand(len(sample.token_ids)),
                                                     version)
                                       for sample, sample_versions in zip(output.outputs, versions, strict=True)]
                        if key is not None:  # (one sample: see generate_n)
                            completions[0].routed_experts = self.engine.fit_routing(records.get(key), completions[0])
                        future.set_result(completions)
                await self._notify_stepped()
                # Let episodes whose tools finished queue their next turn before the next step.
                await asyncio.sleep(0)
        finally:
            if self._in_flight is not None:  # stopped between two steps: nobody awaits this one
                self._in_flight.cancel()
                self._in_flight = None

    def _submit_step(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[StepResult]:
        """Sends one step, with the requests queued since the last, to the engine's thread."""
        to_add, self._to_add = self._to_add, []
        # The keys of every request this step can finish (the engine's thread reads this copy).
        keys = dict(self._routing_keys) if self._routing_keys else {}
        assert self._engine_thread is not None
        return loop.run_in_executor(self._engine_thread, self._step, to_add, keys)

    async def _notify_stepped(self) -> None:
        async with self._stepped:
            self._stepped.notify_all()

    def _step(self, to_add: list[tuple[str, Any, Any]], routing_keys: dict[str, str]) -> StepResult:
        """(On the engine's thread.) Adds `to_add`, runs one engine step; returns `to_add`, the policy version
        it ran under (weights change only between steps), its outputs (finished ones with their
        texts: `fill_texts`), and the routing records of the requests it finished (one fetch: an
        RPC to the multiprocess engine core)."""
        from titanrl.rollout.vllm.detokenize import fill_texts

        llm_engine = self.engine.llm.llm_engine
        for request_id, inputs, params in to_add:
            llm_engine.add_request(request_id, inputs, params)
        version = self.engine.policy_version
        outputs = llm_engine.step()
        tokenizer = None
        for output in outputs:
            params = self._decoded_at_finish.get(output.request_id) if output.finished else None
            if params is not None:
                tokenizer = tokenizer or self.engine.llm.get_tokenizer()
                fill_texts(tokenizer, output, params)
        keys = [routing_keys[o.request_id] for o in outputs if o.finished and o.request_id in routing_keys]
        records = self.engine.take_routed_experts(keys) if keys else {}
        return to_add, version, outputs, records

    async def update_weights(self, state_dict: dict, version: int, regenerate: bool = False) -> None:
        """Loads new weights (a state dict) between two engine steps, with requests in flight.

        The load runs on the engine's thread between two steps, so no step ever mixes two
        versions. Running requests keep their tokens and get their KV cache recomputed with the
        new weights; with `regenerate` they are aborted instead and their
        callers get `WeightsChanged` (to start over with the new weights).
        """
        await self.apply_update(
            lambda: self.engine.update_weights(state_dict, version, recompute_running=True), version, regenerate)

    async def apply_update(self, load: Callable[[], object], version: int, regenerate: bool = False) -> None:
        """`update_weights` for any loader: `load()` must install `version` in the engine with
        `recompute_running=True` (e.g. a `titanrl.rollout.weight_receiver.WeightReceiver.receive` call)."""
        if regenerate and self._pending:
            futures = list(self._pending.values())
            await self._abort()
            for future in futures:
                if not future.done():
                    future.set_exception(WeightsChanged(f"weights changed to version {version}"))
        if self.defer_loads and not regenerate:
            async with self._stepped:
                await self._stepped.wait_for(lambda: self._worth_loading(version))
        await self.on_engine(self._load, load, version)
        if self.engine.policy_version != version:
            raise RuntimeError(f"loading version {version} left the engine at version {self.engine.policy_version}")
        async with self._version_changed:
            self._version_changed.notify_all()

    def _load(self, load: Callable[[], object], version: int) -> None:
        """(On the engine's thread, between two steps.) Runs `load` and records, for every running
        request, how many of its tokens older weights sampled: its later ones come from `version`.
        Recorded here, before any later step can finish one of them (the loop hands a step's
        finished requests back after the engine has moved on: `_pump_steps`)."""
        counts = self._running_tokens()
        load()
        for (request_id, index), num_tokens in counts.items():
            versions = self._versions.get(request_id)
            if versions is not None:
                versions[index].changes.append((num_tokens, version))

    def _worth_loading(self, version: int) -> bool:
        """Whether a deferred load of `version` should land now: nothing would be recomputed, or
        it lets at least as many waiting requests start (in the engine's free sequence slots) as
        it would recompute (module docstring)."""
        if self._pump is None or self._pump.done():
            return True  # no step will come to wait for
        queued = {request_id for request_id, _, _ in self._to_add}
        in_engine = sum(len(samples) for request_id, samples in self._versions.items() if request_id not in queued)
        released = sum(n for needed, n in self._waiting.items() if self.engine.policy_version < needed <= version)
        startable = min(released, self.engine.config.settings.max_num_seqs - in_engine)
        return in_engine == 0 or startable >= in_engine

    def _running_tokens(self) -> dict[tuple[str, int], int]:
        """(On the engine's thread.) Tokens sampled so far by each sample (request id, index) of
        our requests the engine is running (vLLM's output processor counts them as it
        detokenizes every step; a request of n samples runs as n child requests)."""
        request_ids = list(self._versions)
        if not request_ids:
            return {}
        processor = self.engine.llm.llm_engine.output_processor
        counts = {}
        for request_id in request_ids:
            for internal_id in processor.external_req_ids.get(request_id, ()):
                state = processor.request_states.get(internal_id)
                if state is not None and state.detokenizer is not None:
                    counts[request_id, state.request_index] = state.detokenizer.num_output_tokens()
        return counts

    async def running_tokens(self) -> dict[tuple[str, int], int]:
        """Tokens sampled so far by each running sample (request id, index), between two engine steps."""
        return await self.on_engine(self._running_tokens)

    async def wait_for_version(self, version: int, requests: int = 1) -> None:
        """Returns once the engine holds weights of `version` or newer; `requests` is how many
        requests the caller starts then (what a deferred load weighs against its recompute)."""
        if self.engine.policy_version >= version:
            return
        self._waiting[version] = self._waiting.get(version, 0) + requests
        try:
            await self._notify_stepped()
            async with self._version_changed:
                await self._version_changed.wait_for(lambda: self.engine.policy_version >= version)
        finally:
            self._waiting[version] -= requests
            if not self._waiting[version]:
                del self._waiting[version]

    async def _abort(self) -> None:
        """Aborts every pending request (dropping those not yet handed to the engine) and what the
        engine recorded for them; the bookkeeping is cleared here, at once, so a request that
        arrives meanwhile is kept."""
        queued = {request_id for request_id, _, _ in self._to_add}
        running = [request_id for request_id in self._pending if request_id not in queued]
        keys = list(self._routing_keys.values())
        self._to_add.clear()
        self._pending.clear()
        self._versions.clear()
        self._routing_keys.clear()
        self._decoded_at_finish.clear()

        def abort() -> None:
            self.engine.llm.llm_engine.abort_request(running)
            if keys:
                self.engine.take_routed_experts(keys)

        await self.on_engine(abort)
