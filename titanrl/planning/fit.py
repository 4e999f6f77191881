"""The run's `auto` memory settings, chosen from the memory plan before any actor starts.

A run on one CPU host holds, at its peak:

    trainer ranks x trainer peak (titanrl.planning.memory)
    + rollout workers x worker peak (titanrl.planning.worker_memory)
    + the weight transport's copy: the version being pushed next to the one the workers read
      (a shared-memory segment or an object-store object; two in continuous mode)

and all of it must stay under the line where Ray's memory monitor starts killing processes
(`RAY_memory_usage_threshold` of the node's memory, 0.95 by default), less what is in use before
the run, Ray's own processes and a margin (`NodeMemory.budget`).

The rule is the fastest settings that fit, in this order of giving up speed:

1. the trainer: no activation checkpointing with a data-parallel rank's whole batch in one
   micro-batch; then smaller micro-batches (halving, down to 1); then every block checkpointed,
   again from the whole batch down to 1 (checkpointing recomputes each block's forward, about 1/3
   more compute, which costs more than more micro-batches on CPU);
2. the workers: vLLM's packed-weight kernels on, then off (one copy of the linear weights less);
3. the KV cache: room for the worker's share of a step's sequences at max_model_len tokens, in
   whole GiB (at least 1: vLLM's CPU cache comes in whole GiB), then halving down to what one
   max_model_len sequence needs (fewer sequences in flight).

Each worker option is tried with every trainer option before the next. An explicit value is
never changed: it is the only option of its setting. When nothing fits, a run with every memory
setting on `auto` is refused (`MemoryFit.refusal`); a run with an explicit value that the plan
says cannot fit starts with a warning that names the numbers.

Sequences are planned at their longest: the data's longest prompt plus max_new_tokens (when the
driver has counted the prompts; else rollout.engine.max_model_len; env.max_total_tokens for
environment runs), so a run whose completions stop early holds less than planned.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
import dataclasses
from dataclasses import dataclass, replace
from typing import Literal

from titanrl.config.resolve import ResolvedRunConfig, episode_completion_tokens
from titanrl.config.schema import ActivationCheckpointing, RunConfig, compute_dtype
from titanrl.config.unplanned import concrete_engine, concrete_train
from titanrl.errors import ConfigError
from titanrl.planning.memory import GiB, Layout, MemoryEstimate, Workload, estimate
from titanrl.planning.shape import ModelShape, PlanInputError
from titanrl.planning.worker_memory import WorkerEstimate, estimate_worker, kv_bytes_per_token

RAY_KILL_FRACTION_DEFAULT = 0.95
"""Ray's memory monitor kills a process when the node's used memory passes this fraction
(`RAY_memory_usage_threshold`, read from the environment when set)."""
MARGIN_FRACTION = 0.05
"""Kept free below Ray's line, of the node's memory: the estimate's error, allocator
fragmentation, and what other processes start during the run."""
RAY_PROCESSES_BYTES = int(0.5 * GiB)
"""Ray's own processes (raylet, GCS, dashboard, idle workers) and the driver's growth after
start-up: on the Qwen3-0.6B run (2026-12-06, 2-core EPYC) the node's used memory exceeded the
actors' and the driver's resident sets by 0.44 GiB, the operating system's share included (which
the in-use memory measured before start-up already counts), rounded up."""
KV_GRANULE_GIB = 1.0
"""KV-cache sizes are whole GiB: vLLM's CPU backend sizes its cache by VLLM_CPU_KVCACHE_SPACE, an
integer (a 0.5 GiB request ran with the same resident memory as 1 GiB)."""

log = logging.getLogger("titanrl")


@dataclass(frozen=True)
class NodeMemory:
    """The host's memory as Ray's memory monitor sees it."""

    total: int
    """Bytes of memory on the node."""
    in_use: int
    """Bytes in use before the run's actors start (other processes, this driver)."""
    kill_fraction: float = RAY_KILL_FRACTION_DEFAULT
    """Ray's memory monitor threshold (RAY_memory_usage_threshold)."""

    @classmethod
    def of_this_host(cls) -> NodeMemory:
        import psutil

        vm = psutil.virtual_memory()
        threshold = float(os.environ.get("RAY_memory_usage_threshold", RAY_KILL_FRACTION_DEFAULT))
        return cls(total=vm.total, in_use=vm.total - vm.available, kill_fraction=threshold)

    @property
    def budget(self) -> int:
        """Bytes the run's actors and transport may hold together."""
        return int(self.total * (self.kill_fraction - MARGIN_FRACTION)) - self.in_use - RAY_PROCESSES_BYTES

    def describe(self) -> str:
        return (f"{self.budget / GiB:.1f} GiB: {self.kill_fraction:.0%} of the node's {self.total / GiB:.1f} GiB "
                f"(Ray's memory monitor's line) less {MARGIN_FRACTION:.0%} margin, "
                f"{self.in_use / GiB:.1f} GiB in use and {RAY_PROCESSES_BYTES / GiB:.2f} GiB for Ray's processes")


@dataclass(frozen=True)
class TrainerOption:
    activation_checkpointing: ActivationCheckpointing
    micro_batch_size: int


@dataclass(frozen=True)
class WorkerOption:
    vllm_kernels: bool
    kv_cache_gib: float


@dataclass(frozen=True)
class MemoryFit:
    """The settings chosen and what the plan says they hold."""

    trainer_option: TrainerOption
    worker_option: WorkerOption
    trainer: MemoryEstimate
    """One trainer rank's estimate (the busiest)."""
    trainer_ranks: int
    worker: WorkerEstimate
    workers: int
    transport: int
    """Bytes of the weight version being pushed beside the one in use."""
    node: NodeMemory
    auto: tuple[str, ...]
    """The settings that were 'auto' (dotted keys)."""
    seq_len: int
    """Tokens per sequence the trainer's step was planned at (`planned_seq_len`)."""

    @property
    def total(self) -> int:
        return self.trainer_ranks * self.trainer.peak + self.workers * self.worker.peak + self.transport

    @property
    def fits(self) -> bool:
        return self.total <= self.node.budget

    def settings(self) -> dict[str, object]:
        t, w = self.trainer_option, self.worker_option
        return {"train.memory.activation_checkpointing": t.activation_checkpointing,
                "train.memory.micro_batch_size": t.micro_batch_size,
                "rollout.engine.vllm_kernels": w.vllm_kernels, "rollout.engine.kv_cache_gib": w.kv_cache_gib}

    def _chosen(self, prefix: str) -> str:
        parts = [f"{k.rsplit('.', 1)[1]}={v}" + (" (auto)" if k in self.auto else "")
                 for k, v in self.settings().items() if k.startswith(prefix)]
        return ", ".join(parts)

    def lines(self) -> list[str]:
        """The start-up lines: one per actor kind, then the node's total."""
        t, w = self.trainer, self.worker
        return [
            f"memory plan, trainer ({self.trainer_ranks} rank(s), sequences of up to {self.seq_len} tokens): "
            f"{self._chosen('train.')}; estimate "
            f"{t.peak / GiB:.2f} GiB per rank (weights, gradients and AdamW {t.resident / GiB:.2f}; then the larger "
            f"of a step's activations {t.activations / GiB:.2f} + logits {t.logits / GiB:.2f} + embedding "
            f"gradients {t.embedding_gradients / GiB:.2f} and a checkpoint export's copy {t.export_copy / GiB:.2f}; "
            f"process {t.baseline / GiB:.2f})",
            f"memory plan, rollout worker (x{self.workers}): {self._chosen('rollout.')}; estimate {w.peak / GiB:.2f} "
            f"GiB each (weights {w.weights / GiB:.2f}, packed kernels {w.packed / GiB:.2f}, KV cache "
            f"{w.kv_cache / GiB:.2f}, sampler {w.sampler / GiB:.2f}, process {w.baseline / GiB:.2f})",
            f"memory plan, node: {self.total / GiB:.1f} GiB with the pushed version's {self.transport / GiB:.2f} "
            f"GiB, of a budget of {self.node.describe()}",
        ]

    def record(self) -> dict:
        """JSON-ready: what config.resolved.json keeps under resolved.memory."""
        return {"settings": self.settings(), "auto": list(self.auto), "fits": self.fits, "seq_len": self.seq_len,
                "total_bytes": self.total, "budget_bytes": self.node.budget, "node_total_bytes": self.node.total,
                "node_in_use_bytes": self.node.in_use, "transport_bytes": self.transport,
                "trainer_ranks": self.trainer_ranks, "workers": self.workers,
                "trainer": {k: v for k, v in self.trainer.as_dict().items() if k not in ("layout", "schedule")},
                "worker": self.worker.as_dict()}

    def warning(self) -> str:
        explicit = [k for k in self.settings() if k not in self.auto]
        return (f"the memory plan says this run does not fit: {self.total / GiB:.1f} GiB against a budget of "
                f"{self.node.budget / GiB:.1f} GiB; the explicit settings {', '.join(explicit)} are kept. "
                + "; ".join(self.lines()))

    def refusal(self, hints: list[str]) -> str:
        return (f"this run does not fit this machine's memory even at the smallest memory settings: the memory "
                f"plan estimates {self.total / GiB:.1f} GiB against a budget of {self.node.budget / GiB:.1f} GiB. "
                + "; ".join(self.lines())
                + (" What would fit: " + "; ".join(hints) + "." if hints else
                   f" No single change would fit: a node with at least {self.needed_node_gib():.0f} GiB of "
                   "memory, or a smaller model, would.")
                + " (An explicit value of a memory setting starts the run anyway, with a warning.)")

    def needed_node_gib(self) -> float:
        n = self.node
        return (self.total + n.in_use + RAY_PROCESSES_BYTES) / (n.kill_fraction - MARGIN_FRACTION) / GiB


AUTO_KEYS = ("train.memory.activation_checkpointing", "train.memory.micro_batch_size",
             "rollout.engine.vllm_kernels", "rollout.engine.kv_cache_gib")


def auto_keys(config: RunConfig) -> tuple[str, ...]:
    m, e = config.train.memory, config.rollout.engine
    values = dict(zip(AUTO_KEYS, (m.activation_checkpointing, m.micro_batch_size, e.vllm_kernels, e.kv_cache_gib),
                      strict=True))
    return tuple(k for k, v in values.items() if v == "auto")


def planned_seq_len(config: RunConfig, longest_prompt: int | None = None) -> int:
    """The longest sequence a sample can be (what the plan assumes every sequence is): the longest
    prompt of the data plus max_new_tokens when the prompts were counted, else max_model_len."""
    e = config.rollout.engine
    if config.runs_episodes:
        return min(episode_completion_tokens(config), e.max_model_len)
    if longest_prompt is not None:
        return min(e.max_model_len, longest_prompt + config.rollout.sampling.max_new_tokens)
    return e.max_model_len


def layout_of(config: RunConfig) -> Layout:
    p = config.train.parallel
    return Layout(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                  sequence_parallel=p.sequence_parallel,
                  pp_schedule=p.pp_schedule if p.pp_schedule in ("1F1B", "GPipe") else "1F1B")


def _halvings(start: int) -> list[int]:
    """start, then the powers of two below it down to 1."""
    below = 1 << (start.bit_length() - 1)  # the largest power of two <= start
    return [start] + [1 << k for k in range(below.bit_length() - 1, -1, -1) if 1 << k < start]


def trainer_options(config: RunConfig, layout: Layout) -> list[TrainerOption]:
    """Fastest first (the module docstring's order); an explicit value is the only option of its setting."""
    m = config.train.memory
    rows = -(-config.rollout.prompts_per_step * config.rollout.group_size // layout.dp)
    sizes = _halvings(rows) if m.micro_batch_size == "auto" else [int(m.micro_batch_size)]
    modes: list[ActivationCheckpointing] = (["none", "full"] if m.activation_checkpointing == "auto"
                                            else [m.activation_checkpointing])
    return [TrainerOption(mode, size) for mode in modes for size in sizes]


def kv_sizes_gib(config: RunConfig, shape: ModelShape, dtype: str) -> list[float]:
    """KV-cache sizes to try, largest first (an explicit size is the only one)."""
    e = config.rollout.engine
    if e.kv_cache_gib != "auto":
        return [float(e.kv_cache_gib)]
    per_sequence = e.max_model_len * kv_bytes_per_token(shape, dtype) / GiB
    rows = -(-config.rollout.prompts_per_step * config.rollout.group_size // config.rollout.num_workers)
    granule = lambda gib: math.ceil(gib / KV_GRANULE_GIB) * KV_GRANULE_GIB  # noqa: E731
    least = granule(per_sequence)
    sizes = [granule(min(rows, e.max_num_seqs) * per_sequence)]
    while sizes[-1] / 2 >= least:
        sizes.append(granule(sizes[-1] / 2))
    if sizes[-1] > least:
        sizes.append(least)
    return sizes


def worker_options(config: RunConfig, shape: ModelShape, dtype: str) -> list[WorkerOption]:
    e = config.rollout.engine
    kernels = [True, False] if e.vllm_kernels == "auto" else [bool(e.vllm_kernels)]
    sizes = kv_sizes_gib(config, shape, dtype)
    # Kernels off before a smaller KV cache: fewer sequences in flight costs generation more.
    return [WorkerOption(k, sizes[0]) for k in kernels] + [WorkerOption(kernels[-1], s) for s in sizes[1:]]


def trainer_workload(config: RunConfig, longest_prompt: int | None = None,
                     shape: ModelShape | None = None) -> Workload:
    """One step of this run as the plan sees it (sequences at `planned_seq_len`, on CPU); with
    `shape`, a LoRA run's adapter and merged-weight elements too."""
    adapters, merged = lora_elements(config, shape) if shape is not None else (0, 0)
    return Workload(seq_len=planned_seq_len(config, longest_prompt), batch=config.rollout.prompts_per_step * config.rollout.group_size,
                    dtype=config.model.dtype, compute_dtype=compute_dtype(config.model, config.train),
                    logprob_chunk_tokens=config.train.memory.logprob_chunk_tokens, device="cpu",
                    kl_reference=config.train.kl.coef > 0, packed=config.train.compute.pack_sequences,
                    lora_adapter_elements=adapters, lora_merged_elements=merged)


def lora_elements(config: RunConfig, shape: ModelShape) -> tuple[int, int]:
    """(adapter factor elements over every layer, merged-weight elements the trainer may hold at
    once) of a LoRA run; (0, 0) without LoRA. The merged form (lora.sync='merged') builds each
    adapted linear's merged weight for its matmul: one block's at most (a block recomputed under
    full checkpointing keeps them for its backward; otherwise each lives through its matmul alone);
    the unmerged form builds none. A target's (in, out) comes from the dense decoder's projections
    (the model spec's)."""
    lora = config.lora
    if lora.rank <= 0:
        return 0, 0
    from titanrl.models.spec import decoder_linear_shapes

    dims = decoder_linear_shapes(shape.hidden_size, shape.intermediate_size,
                                 shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim)
    targets = lora.target_modules if lora.target_modules is not None else list(dims)
    adapters = sum(lora.rank * (dims[t][0] + dims[t][1]) for t in targets if t in dims)
    merged = sum(dims[t][0] * dims[t][1] for t in targets if t in dims) if lora.sync == "merged" else 0
    return adapters * shape.num_hidden_layers, merged


def _candidates(config: RunConfig, shape: ModelShape, node: NodeMemory,
                longest_prompt: int | None = None) -> Iterator[MemoryFit]:
    layout = layout_of(config)
    generator_dtype = config.generator_dtype
    work = trainer_workload(config, longest_prompt, shape)
    weights = shape.total_params * (2 if generator_dtype != "float32" else 4)
    transport = weights * (2 if config.rollout.continuous else 1)
    auto = auto_keys(config)
    for w in worker_options(config, shape, generator_dtype):
        worker = estimate_worker(shape, dtype=generator_dtype, kv_cache_bytes=int(w.kv_cache_gib * GiB),
                                 max_num_seqs=config.rollout.engine.max_num_seqs,
                                 vllm_kernels=w.vllm_kernels and not config.batch_invariant)
        for t in trainer_options(config, layout):
            # The plan knows 'none' and 'full'; every_nth stores at most what 'none' does.
            mode: Literal["none", "full"] = "full" if t.activation_checkpointing == "full" else "none"
            trainer = estimate(shape, layout, replace(work, micro_batch=t.micro_batch_size, activation_checkpointing=mode))
            yield MemoryFit(t, w, trainer, layout.world_size, worker, config.rollout.num_workers, transport, node, auto,
                            work.seq_len)


def fit_memory(config: RunConfig, shape: ModelShape, node: NodeMemory, longest_prompt: int | None = None) -> MemoryFit:
    """The first candidate that fits (the fastest), else the last one (the smallest), whose
    `fits` is then False. `longest_prompt`: tokens of the data's longest prompt (None: unknown)."""
    last = None
    for last in _candidates(config, shape, node, longest_prompt):
        if last.fits:
            return last
    assert last is not None  # every setting has at least one option
    return last


def what_would_fit(config: RunConfig, shape: ModelShape, node: NodeMemory, longest_prompt: int | None = None) -> list[str]:
    """Single changes of the run (not of the memory settings, already at their smallest) that would fit."""
    e, r = config.rollout.engine, config.rollout
    changes: list[tuple[str, RunConfig]] = []
    if compute_dtype(config.model, config.train) == "float32":
        # Half the generators' weights, the pushed copy and the activations; storage (and so the
        # trainer's weights, gradients and AdamW state) stays float32.
        compute = dataclasses.replace(config.train.compute, dtype="bfloat16")
        changes.append(("train.compute.dtype=bfloat16",
                        dataclasses.replace(config, train=dataclasses.replace(config.train, compute=compute))))
    if r.num_workers > 1:
        changes.append((f"rollout.num_workers={r.num_workers - 1}",
                        dataclasses.replace(config, rollout=dataclasses.replace(r, num_workers=r.num_workers - 1))))
    if e.max_model_len // 2 >= config.rollout.sampling.max_new_tokens + 16:  # still room for a prompt
        shorter = dataclasses.replace(e, max_model_len=e.max_model_len // 2)
        changes.append((f"rollout.engine.max_model_len={e.max_model_len // 2}",
                        dataclasses.replace(config, rollout=dataclasses.replace(r, engine=shorter))))
    if e.max_num_seqs > 16:
        fewer = dataclasses.replace(e, max_num_seqs=16)
        changes.append(("rollout.engine.max_num_seqs=16", dataclasses.replace(config, rollout=dataclasses.replace(r, engine=fewer))))
    out = []
    for text, changed in changes:
        fit = fit_memory(changed, shape, node, longest_prompt)
        if fit.fits:
            out.append(f"{text} ({fit.total / GiB:.1f} GiB)")
    return out


def unplanned_reason(config: RunConfig) -> str:
    """Why the memory plan does not cover this run, or '' when it does (one CPU host)."""
    import torch

    if config.ray_address:
        return "a Ray cluster joined by address: the plan covers a run on this host"
    if config.train.compute.device not in ("auto", "cpu"):
        return f"train.compute.device={config.train.compute.device}: the plan covers CPU runs"
    if torch.cuda.is_available():
        return "this host has GPUs: the plan covers CPU runs"
    return ""


def plan_memory(config: RunConfig, node: NodeMemory | None = None, longest_prompt: int | None = None
                ) -> tuple[RunConfig, MemoryFit | None, str]:
    """`config` with its `auto` memory settings chosen (see the module docstring), the fit, and why
    there is none ('' when there is one). Raises ConfigError when even the smallest settings
    cannot fit; logs a warning when explicit settings keep the run from fitting. `longest_prompt`:
    tokens of the data's longest prompt (`titanrl.data.longest_prompt_tokens`; None: unknown)."""
    reason = unplanned_reason(config)
    shape = None
    if not reason:
        try:
            shape = ModelShape.from_config_json(config.model.checkpoint)
        except PlanInputError as e:
            reason = f"the checkpoint's shape is not plannable: {e}"
    if shape is None:
        rollout = dataclasses.replace(config.rollout, engine=concrete_engine(config.rollout.engine))
        return dataclasses.replace(config, train=concrete_train(config.train), rollout=rollout), None, reason
    node = node or NodeMemory.of_this_host()
    fit = fit_memory(config, shape, node, longest_prompt)
    if not fit.fits:
        if len(fit.auto) == len(AUTO_KEYS):  # every memory setting was the plan's to choose
            raise ConfigError(fit.refusal(what_would_fit(config, shape, node, longest_prompt)))
        log.warning(fit.warning())
    t, w = fit.trainer_option, fit.worker_option
    memory = dataclasses.replace(config.train.memory, activation_checkpointing=t.activation_checkpointing,
                                 micro_batch_size=t.micro_batch_size)
    engine = dataclasses.replace(config.rollout.engine, vllm_kernels=w.vllm_kernels, kv_cache_gib=w.kv_cache_gib)
    planned = dataclasses.replace(config, train=dataclasses.replace(config.train, memory=memory),
                                  rollout=dataclasses.replace(config.rollout, engine=engine))
    return planned, fit, ""


def with_memory_plan(resolved: ResolvedRunConfig, node: NodeMemory | None = None,
                     longest_prompt: int | None = None) -> ResolvedRunConfig:
    """`resolved` with its `auto` memory settings chosen (`plan_memory`) and the plan kept."""
    planned, fit, reason = plan_memory(resolved.config, node, longest_prompt)
    if fit is None:
        summary = (f"memory plan: none ({reason}); the 'auto' memory settings take their unplanned values",)
        return dataclasses.replace(resolved, config=planned, memory_summary=summary)
    return dataclasses.replace(resolved, config=planned, memory=fit.record(), memory_summary=tuple(fit.lines()))
