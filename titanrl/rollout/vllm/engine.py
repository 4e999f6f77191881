"""Rollout engine on vLLM running TitanRL's own Qwen3 modules, with in-place weight pushes.

    engine = VllmEngine(VllmEngineConfig(checkpoint="ckpt/"))
    groups = engine.generate(["1+1="], n=8, temperature=1.0, max_tokens=16, seed=0)
    engine.update_weights(trainer_state_dict, version=1)   # no restart
    engine.close()

Log-probabilities (`VllmEngineConfig.logprobs`): 'sampled' creates the engine with
`logprobs_mode="processed_logprobs"`, so the logprob returned for each sampled token is that of
the distribution it was sampled from: log_softmax(logits / temperature) in float32, with top-k /
top-p renormalised over the kept tokens (the others at -inf), which the trainer recomputes
(`titanrl.trainer.truncation`). 'raw' creates it with `logprobs_mode="raw_logprobs"`: log_softmax
of the logits before temperature, penalties and truncation (vLLM's Sampler computes it first),
the full softmax at temperature 1. Greedy requests (temperature 0) report log_softmax(logits)
in both modes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from titanrl.busy_flags import BusySlot
from titanrl.config.schema import EngineConfig, LoraConfig
from titanrl.config.unplanned import concrete_engine
from titanrl.rollout.vllm.names import BATCH_INVARIANT_KEY, LORA_KEY, VLLM_KERNELS_KEY
from titanrl.rollout.vllm.plugin import register
from titanrl.rollout.vllm.routing_record import ROUTING_KEY, fit_routing
from titanrl.rollout.vllm.worker_extension import EXTENSION_QUALNAME

if TYPE_CHECKING:
    from titanrl.weight_sync import WeightAnnouncement, WeightSyncPlan
    from titanrl.weight_sync.shared_memory import SharedMemorySender


def adapter_sync(lora: LoraConfig) -> dict | None:
    """`VllmEngineConfig.lora` for a run's lora section: {'rank', 'alpha', 'target_modules'} when
    pushes carry the adapters alone (lora.rank > 0, lora.sync='adapter'), else None."""
    if lora.rank <= 0 or lora.sync != "adapter":
        return None
    return {"rank": lora.rank, "alpha": lora.alpha,
            "target_modules": None if lora.target_modules is None else list(lora.target_modules)}


@dataclass
class VllmEngineConfig:
    """How to start a vLLM engine for rollouts."""

    checkpoint: str
    """HF checkpoint directory (config.json + safetensors + tokenizer) to start from."""
    dtype: str = "float32"
    """Weight/activation dtype; float32 is faster than bfloat16 on CPUs without bf16 units."""
    settings: EngineConfig = field(default_factory=EngineConfig)
    """The run's `rollout.engine` section: lengths, batch, KV cache, threads, kernels, multiprocess,
    routing capture. `record_routed_experts` must be resolved (`titanrl.config.resolve`): None is off."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use on GPU (ignored on CPU)."""
    enforce_eager: bool = True
    """Skip torch.compile/graph capture: saves 35-50 s of start-up on CPU."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (a GRPO group shares its prompt); reset on every push."""
    kv_block_size: int = 32
    """Tokens per KV-cache block. Prefix caching shares whole blocks only, so a group's samples
    share a prompt's first `len // kv_block_size` blocks and recompute the rest. vLLM's CPU default
    (128) shares nothing of prompts shorter than 128 tokens; 32 is the smallest its CPU attention
    kernel takes. Measured (benchmarks/prefill_sharing.py on an AMD EPYC with AVX-512: SmolLM2-135M,
    16 prompts of ~84 tokens x 8 samples, 1 thread): prefill 25.3 s at 128 -> 8.1 s at 32, with 64 new tokens
    42.4 -> 25.0 s, the same tokens sampled."""
    enable_chunked_prefill: bool = False
    """Split long prefills across engine steps. Off by default: vLLM on CPU fails a *seeded*
    request whose prompt gets split (`RuntimeError: CPU Generator does not use offset` in
    `gpu_model_runner._bookkeeping_sync`), which multi-turn episodes hit when many long
    contexts arrive at once. Off, a prompt waits until it fits one step's token budget."""
    seed: int = 0
    """Engine seed (requests without their own seed draw from it)."""
    batch_invariant: bool = False
    """Run our model through `titanrl.kernels` (including attention over the paged cache), so
    its logprobs equal the trainer's bit for bit; see `titanrl.rollout.vllm.paged_attention`."""
    logprobs: str = "sampled"
    """Which logprobs generated tokens carry: 'sampled' (vLLM's processed logprobs, after
    temperature and top-k / top-p) or 'raw' (vLLM's raw logprobs, before both); rollout.sampling.logprobs."""
    lora: dict | None = None
    """{'rank', 'alpha', 'target_modules'} of a run with lora.sync='adapter': the model carries
    the trainer's low-rank adapters and pushes carry those alone (titanrl.models.common.lora);
    None: pushes carry full weights."""
    extra_llm_kwargs: dict = field(default_factory=dict)
    """Passed to `vllm.LLM(...)` last, for options not surfaced here."""
    warm_up: bool = True
    """Generate two short requests (greedy and sampled) before the engine serves anything, so the
    one-time costs of the first generation (vLLM's sampler is compiled by inductor on first use,
    2-5 s on CPU) are paid at start-up instead of inside the first training step."""

    def __post_init__(self) -> None:
        if not (Path(self.checkpoint) / "config.json").is_file():
            raise ValueError(f"VllmEngineConfig.checkpoint={self.checkpoint!r} has no config.json")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"VllmEngineConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.logprobs not in ("sampled", "raw"):
            raise ValueError(f"VllmEngineConfig.logprobs must be 'sampled' or 'raw', got {self.logprobs!r}")
        s = self.settings = concrete_engine(self.settings)  # an 'auto' KV cache a driver did not plan
        if s.max_model_len <= 0 or s.max_num_seqs <= 0 or s.kv_cache_gib <= 0:
            raise ValueError("VllmEngineConfig.settings' max_model_len, max_num_seqs and kv_cache_gib must be positive")


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_token_ids: list[int]
    """Token ids of the prompt as the engine saw them (after tokenisation)."""
    token_ids: list[int]
    """Generated token ids (includes the stop/EOS token when generation ended on one)."""
    text: str
    """Detokenised completion text."""
    logprobs: list[float]
    """Per generated token, log-prob of that token under the sampling distribution."""
    finish_reason: str | None
    """'stop' (EOS / stop token), 'length' (max_tokens) or None."""
    policy_version: int
    """Oldest policy version among its tokens (the version it started with)."""
    token_versions: list[int] = field(default_factory=list)
    """Per generated token, the policy version whose weights sampled it; they differ only when
    new weights arrived while it was running (`AsyncGenerator.update_weights`)."""
    routed_experts: np.ndarray | None = None
    """With `record_routed_experts`: int16 [len(prompt) + len(tokens), sparse layers, k], the
    experts each position was routed through; -1 where not computed (prefix-cache hits, the
    last token). None when not recording."""

    @classmethod
    def of(cls, output: Any, sample: Any, versions: list[int], version: int) -> Completion:
        """Sample `sample` (a vLLM CompletionOutput) of the finished request `output`; `versions`:
        the policy version of each of its tokens (extra entries are dropped), `version`: the
        policy version of a completion without tokens."""
        ids = list(sample.token_ids)
        versions = versions[: len(ids)]
        return cls(
            prompt_token_ids=list(output.prompt_token_ids or []),
            token_ids=ids,
            text=sample.text,
            logprobs=sampled_logprobs(sample.logprobs, ids),
            finish_reason=sample.finish_reason,
            policy_version=min(versions, default=version),
            token_versions=versions,
        )


def sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The logprob of each sampled token in `ids`, from vLLM's per-position logprobs (a list of
    {token: Logprob} or, as our requests ask for, `FlatLogprobs`). Requests ask for the sampled
    token's logprob alone (`logprobs=0`), so a flat record is usually exactly one entry per
    position, the sampled one: read in one slice."""
    from vllm.logprobs import FlatLogprobs

    if isinstance(logprobs, FlatLogprobs) and len(logprobs.logprobs) == len(ids) and logprobs.token_ids == ids:
        return list(logprobs.logprobs)
    return [float(pos[t].logprob) for pos, t in zip(logprobs or [], ids, strict=False)]


def _has_entry_point() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value.startswith("titanrl.") for ep in entry_points(group="vllm.general_plugins"))


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for vLLM start-up (spawned processes inherit them)."""
    import vllm.envs

    # vLLM caches its env vars once an engine has started in this process; without this
    # a second engine would ignore e.g. a changed VLLM_ENABLE_V1_MULTIPROCESSING.
    vllm.envs.disable_envs_cache()
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_in_process_engines = 0
"""Open in-process engines: they share process-wide state that only the last close may tear down."""
_original_set_num_threads = torch.set_num_threads


def use_intra_op_threads(num_threads: int) -> None:
    """Sets the calling thread's intra-op thread count, also once vLLM's CPU worker has stubbed
    out `torch.set_num_threads`. A thread that steps an engine made on another thread needs this:
    OpenMP keeps the count per thread (a new one starts at OMP_NUM_THREADS, or every core), and
    vLLM's CPU attention fails when a step runs with another count than it planned with."""
    _original_set_num_threads(num_threads)


class VllmEngine:
    """A vLLM `LLM` running our model of the checkpoint's family (`ModelSpec.vllm_architecture`),
    with `generate` and in-place `update_weights`."""

    def __init__(self, config: VllmEngineConfig) -> None:
        if config.settings.multiprocess and not _has_entry_point():
            raise RuntimeError(
                "VllmEngineConfig.multiprocess=True needs the titanrl 'vllm.general_plugins' entry point "
                "(spawned engine processes cannot see a registration made here): `pip install -e .` "
                "the titanrl package, or use multiprocess=False"
            )
        register()  # in-process engines (and the driver's config checks) see our class
        from vllm import LLM

        from titanrl.models.architectures import spec_for
        from titanrl.models.hf_checkpoint import read_config

        self.config = config
        self.model_config = read_config(config.checkpoint)
        self.spec = spec_for(self.model_config)
        if config.settings.record_routed_experts and not self.spec.is_moe:
            raise ValueError(f"VllmEngineConfig.record_routed_experts=True needs a mixture-of-experts checkpoint; "
                             f"{config.checkpoint!r} is {self.model_config.HF_ARCHITECTURE}")
        self.policy_version = 0
        self.last_push_seconds: float | None = None
        self.last_push_views = 0
        """Tensors of the last push that the engine took as views of a shared-memory segment (zero copy)."""
        t0 = time.perf_counter()
        with _env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if config.settings.multiprocess else "0"}):
            kwargs = dict(
                model=str(config.checkpoint),
                tokenizer=str(config.checkpoint),
                hf_overrides={
                    "architectures": [self.spec.vllm_architecture],
                    BATCH_INVARIANT_KEY: config.batch_invariant,
                    VLLM_KERNELS_KEY: config.settings.vllm_kernels,
                    **({LORA_KEY: dict(config.lora)} if config.lora else {}),
                },
                dtype=config.dtype,
                max_model_len=config.settings.max_model_len,
                max_num_seqs=config.settings.max_num_seqs,
                kv_cache_memory_bytes=int(config.settings.kv_cache_gib * 2**30),
                gpu_memory_utilization=config.gpu_memory_utilization,
                enforce_eager=config.enforce_eager,
                enable_prefix_caching=config.enable_prefix_caching,
                block_size=config.kv_block_size,
                seed=config.seed,
                logprobs_mode="processed_logprobs" if config.logprobs == "sampled" else "raw_logprobs",
                worker_extension_cls=EXTENSION_QUALNAME,
                enable_chunked_prefill=config.enable_chunked_prefill,
            )
            if not config.enable_chunked_prefill:
                # Whole prompts only, so one step must fit the longest one.
                kwargs["max_num_batched_tokens"] = max(config.settings.max_model_len, 4096)  # vLLM's CPU default
            self.llm = LLM(**{**kwargs, **config.extra_llm_kwargs})
        self.routing_layers = 0
        """Sparse layers whose routing is recorded (0: not recording)."""
        if config.settings.record_routed_experts:
            self.routing_layers = self.llm.collective_rpc("titanrl_record_routing", args=(True,))[0]
        self._routing_keys = itertools.count()
        if config.warm_up:
            self._warm_up()
        self.start_seconds = time.perf_counter() - t0
        self._local_sender: SharedMemorySender | None = None
        """Multiprocess engine: the segments `update_weights` hands to the engine core (made on first use)."""
        self._closed = False
        self.activity = BusySlot.none()
        """Raised while the engine samples (`generate`, or `AsyncGenerator`'s steps), so the trainer
        can take this worker's cores while it waits (the worker sets it: train.compute.threads_when_rollouts_idle)."""
        if not config.settings.multiprocess:
            global _in_process_engines
            _in_process_engines += 1

    # --- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        top_k: int = 0,
    ) -> list[list[Completion]]:
        """Samples `n` completions per prompt; returns one list of `n` Completions per prompt.

        Prompts are all strings or all token-id lists. With `seed`, sample i of prompt j uses
        seed `seed + j * n + i`, so every sample in the call has its own stream and the call is
        reproducible. A prompt is one vLLM request that vLLM fans out into `n` (child i seeded
        `+ i`): it is tokenized and processed once, not `n` times. With routing recorded, each
        sample is its own request, so its routing can be recorded under its own key.
        """
        from vllm import SamplingParams

        from titanrl.rollout.vllm.detokenize import fill_texts

        self._check_open()
        if not prompts:
            return []
        inputs = self._prompt_inputs(prompts)
        per_sample = self.routing_layers > 0
        requests = len(inputs) * n if per_sample else len(inputs)
        samples = 1 if per_sample else n  # per request
        keys = [self.routing_key() for _ in range(requests)] if per_sample else None
        params = [
            SamplingParams(
                n=samples,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_tokens,
                seed=None if seed is None else seed + r * samples,
                stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
                logprobs=0,
                flat_logprobs=True,  # a few lists per request, not a dict and a Logprob per token
                detokenize=False,  # decoded once it finishes (`titanrl.rollout.vllm.detokenize`)
                extra_args=None if keys is None else {ROUTING_KEY: keys[r]},
                skip_clone=True,  # made for this request alone: vLLM need not deep-copy it
            )
            for r in range(requests)
        ]
        version = self.policy_version
        with self.activity:
            outputs = self.llm.generate([x for x in inputs for _ in range(n // samples)], params, use_tqdm=False)
        records = self.take_routed_experts(keys) if keys is not None else {}
        tokenizer = self.llm.get_tokenizer()
        completions: list[Completion] = []
        for r, out in enumerate(outputs):
            fill_texts(tokenizer, out, params[r])
            for c in out.outputs:
                completion = Completion.of(out, c, [version] * len(c.token_ids), version)
                if keys is not None:
                    completion.routed_experts = self.fit_routing(records.get(keys[r]), completion)
                completions.append(completion)
        return [completions[j * n : (j + 1) * n] for j in range(len(inputs))]

    def _prompt_inputs(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[Any]:
        """vLLM inputs of `generate`'s prompts: token ids as given, text tokenized here in one
        batched call (`tokenize`). Inside `llm.generate` vLLM would render text prompts one by one
        on the engine's thread: 4 % of the arithmetic batch (benchmarks/request_options.py)."""
        from vllm.inputs import TokensPrompt

        if isinstance(prompts[0], str):
            return [TokensPrompt(prompt_token_ids=ids) for ids in self.tokenize(prompts)]  # type: ignore[arg-type]
        return [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]

    def tokenize(self, prompts: Sequence[str]) -> list[list[int]]:
        """The token ids vLLM makes of these text prompts (its tokenizer, with the special tokens it
        adds to a text prompt), from one batched call of the tokenizer."""
        self._check_open()
        return [list(ids) for ids in self.llm.get_tokenizer()(list(prompts), add_special_tokens=True)["input_ids"]]

    def _warm_up(self) -> None:
        """Runs a greedy and a seeded sampled request of two tokens (their routing is not recorded:
        they carry no routing key), then empties the prefix cache."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=t, max_tokens=2, seed=0, logprobs=0) for t in (0.0, 1.0)]
        self.llm.generate([TokensPrompt(prompt_token_ids=[0])] * len(params), params, use_tqdm=False)
        self.llm.reset_prefix_cache()

    # --- routing capture (MoE) --------------------------------------------------------
    def routing_key(self) -> str:
        """A fresh record key for one request (`SamplingParams.extra_args[ROUTING_KEY]`)."""
        return f"r{next(self._routing_keys)}"

    def take_routed_experts(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The records of finished (or aborted) requests, removed from the worker: int16
        [positions, sparse layers, k]; a key whose request computed nothing is absent."""
        self._check_open()
        if not keys:
            return {}
        wire = self.llm.collective_rpc("titanrl_take_routed_experts", args=(list(keys),))[0]
        return {k: np.frombuffer(data, dtype=np.int16).reshape(shape).copy() for k, (shape, data) in wire.items()}

    def fit_routing(self, record: np.ndarray | None, completion: Completion) -> np.ndarray:
        """A record sized to the completion's sequence (prompt + tokens), -1 where not recorded."""
        length = len(completion.prompt_token_ids) + len(completion.token_ids)
        return fit_routing(record, length, self.routing_layers, self.model_config.num_experts_per_tok)

    # --- weights ----------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, allow_partial: bool = False,
                       recompute_running: bool = False) -> None:
        """Copies new weights into the running engine in place and invalidates the prefix cache.

        `state_dict` uses our model's `state_dict()` names (stacked experts `[E, out, in]`), or
        an HF checkpoint's (one tensor per expert, stacked here); a tied LM head is
        dropped (the LM head follows the embedding). Every parameter must be present unless
        `allow_partial`. Must not be called while a `generate` call is running; between two
        engine steps with requests unfinished (`AsyncGenerator`), pass `recompute_running`: those
        requests keep their tokens and vLLM recomputes their KV cache with the new weights.
        """
        self._check_open()
        from titanrl.models.hf_checkpoint import from_checkpoint_tensors

        t0 = time.perf_counter()
        tensors = {}
        for name, t in from_checkpoint_tensors(dict(state_dict)).items():
            if name == self.spec.state_dict_adapter.head and self.model_config.tie_word_embeddings:
                continue
            tensors[name] = t.detach().to("cpu").contiguous()
        if self.config.settings.multiprocess:
            # Tensors in collective_rpc arguments do not survive its serialisation: the engine
            # core maps them from a shared-memory segment of this process instead (no file format).
            from titanrl.weight_sync.source import TensorsWeights

            if self._local_sender is None:
                from titanrl.weight_sync.shared_memory import SharedMemorySender

                self._local_sender = SharedMemorySender(num_receivers=1)
            source = TensorsWeights(tensors)
            ann = self._local_sender.publish(int(version), source)
            self._local_sender.send(int(version), source)  # all written before the engine reads
            results = self.llm.collective_rpc("titanrl_load_shared_memory",
                                              args=(ann.to_wire(), int(version), 1, allow_partial, True))
        else:
            results = self.llm.collective_rpc("titanrl_update_weights", args=(tensors, int(version), allow_partial))
        self._finish_push(results, version, t0, recompute_running)

    def _finish_push(self, results: list[dict], version: int, t0: float, recompute_running: bool = False) -> None:
        """After a push reached the worker(s): check it, invalidate the prefix cache, record the version."""
        if not all(r["version"] == int(version) for r in results):
            raise RuntimeError(f"weight push to version {version} did not reach every worker: {results}")
        if not self.llm.reset_prefix_cache(reset_running_requests=recompute_running):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight push (requests running?)")
        self.policy_version = int(version)
        self.last_push_seconds = time.perf_counter() - t0
        self.last_push_views = min(r.get("views", 0) for r in results)

    # --- weight transports (titanrl.weight_sync) ----------------------------------------
    # The bytes go straight to where the model lives: the worker extension maps the segment or
    # joins the broadcast group itself (in the engine-core process for the multiprocess engine).

    def load_shared_memory(self, announcement: WeightAnnouncement, version: int, rank: int,
                           recompute_running: bool = False, zero_copy: bool = True) -> None:
        """Loads a 'shared_memory' announcement (its segment, mapped by the model's process) as
        `version`; `rank` is this receiver's in the plan (1..num_receivers); `zero_copy`: see
        WeightSyncPlan.zero_copy."""
        self._check_open()
        t0 = time.perf_counter()
        results = self.llm.collective_rpc("titanrl_load_shared_memory",
                                          args=(announcement.to_wire(), int(version), int(rank), False,
                                                bool(zero_copy)))
        self._finish_push(results, version, t0, recompute_running)

    def open_weight_group(self, plan: WeightSyncPlan, rank: int) -> None:
        """Joins the plan's broadcast group as `rank`; blocks until every member has joined."""
        self._check_open()
        self.llm.collective_rpc("titanrl_open_weight_group", args=(plan.to_wire(), int(rank)))

    def receive_broadcast(self, announcement: WeightAnnouncement, version: int,
                          recompute_running: bool = False) -> None:
        """Takes part in the broadcast of a 'broadcast' announcement and loads it as `version`."""
        self._check_open()
        t0 = time.perf_counter()
        results = self.llm.collective_rpc("titanrl_receive_broadcast", args=(announcement.to_wire(), int(version)))
        self._finish_push(results, version, t0, recompute_running)

    def close_weight_sync(self) -> None:
        """Leaves the broadcast group and unmaps the trainer's segments (the engine's own stay)."""
        self._check_open()
        keep = [self._local_sender.sender_id] if self._local_sender is not None else []
        self.llm.collective_rpc("titanrl_close_weight_sync", args=(keep,))

    def worker_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the (first) worker is running, as CPU tensors (for tests and debugging)."""
        from safetensors.torch import load

        self._check_open()
        return load(self.llm.collective_rpc("titanrl_state_dict_bytes")[0])

    # --- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Shuts the engine (and its processes, for the multiprocess engine) down; idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:  # leave a broadcast group and unmap segments while the engine still answers
            self.llm.collective_rpc("titanrl_close_weight_sync", args=([],))
        except Exception:  # an engine that already died holds nothing
            pass
        if self._local_sender is not None:
            self._local_sender.close()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        if not self.config.settings.multiprocess:
            global _in_process_engines
            _in_process_engines -= 1
        if not self.config.settings.multiprocess and _in_process_engines == 0:
            # In-process engines leave process-wide state behind: torch.distributed groups, a
            # frozen GC heap, cached vLLM env vars, a patched torch.set_num_threads (vLLM binds
            # its threads). Another engine still open in this process needs all of it.
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
            torch.set_num_threads = _original_set_num_threads
        import gc

        gc.collect()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VllmEngine is closed")

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
