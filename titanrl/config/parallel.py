"""Checks a parallel layout against the model and the world before any process starts."""

from __future__ import annotations

import math
import typing

from titanrl.config.schema import ParallelConfig, PPSchedule, TrainConfig
from titanrl.errors import ConfigError
from titanrl.models.common.decoder import DecoderConfig

PP_SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}
"""Pipeline schedule names and the number of stages each rank runs."""
assert set(PP_SCHEDULES) == set(typing.get_args(PPSchedule)), "schema.PPSchedule and PP_SCHEDULES must list the same"


def sequence_multiple(parallel: ParallelConfig) -> int:
    """Sequence lengths the parallel step runs must be a multiple of this (it pads to it).

    Load-balanced causal ring attention cuts a sequence into 2 * cp chunks; sequence parallel
    then splits each rank's part into tp pieces.
    """
    multiple = 2 * parallel.cp if parallel.cp > 1 else 1
    if parallel.sequence_parallel and parallel.tp > 1:
        multiple *= parallel.tp
    return multiple


def validate_parallel(
    parallel: ParallelConfig, model_config: DecoderConfig, world_size: int | None, seq_len: int | None = None,
    batch_invariant: bool = False,
) -> None:
    """Raises ConfigError, naming the field to change, when `parallel` cannot run this model.

    world_size: the trainer's process count (None skips that check). seq_len: a sequence length
    the trainer must handle without padding (e.g. rollout.engine.max_model_len); None skips that check.
    batch_invariant: the run's RunConfig.batch_invariant (refused with tp or cp, see
    `check_batch_invariant`).
    """
    p, m = parallel, model_config
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
        value = getattr(p, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"train.parallel.{name} must be an integer >= 1, got {value!r}")
    if world_size is not None and p.world_size != world_size:
        raise ConfigError(
            f"train.parallel degrees multiply to {p.world_size} (dp_replicate={p.dp_replicate} x "
            f"dp_shard={p.dp_shard} x tp={p.tp} x pp={p.pp} x cp={p.cp}; ep borrows ranks) but the trainer "
            f"has {world_size} processes: change the degrees so that their product is {world_size}"
        )
    if p.ep != 1:
        check_expert_parallel(p, m)
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(
            f"train.parallel.pp_schedule={p.pp_schedule!r} is not a schedule; use one of {sorted(PP_SCHEDULES)}"
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(m, field)
        if heads % p.tp:
            raise ConfigError(
                f"train.parallel.tp={p.tp} must divide the model's {field} ({heads}): each tensor-parallel "
                f"rank holds whole heads; pick tp from {_divisors(math.gcd(m.num_attention_heads, m.num_key_value_heads))}"
            )
    if m.intermediate_size % p.tp:
        raise ConfigError(
            f"train.parallel.tp={p.tp} must divide the model's intermediate_size ({m.intermediate_size})"
        )
    if p.pp > 1:
        stages = p.pp * PP_SCHEDULES[p.pp_schedule]
        if m.num_hidden_layers % stages:
            raise ConfigError(
                f"train.parallel.pp={p.pp} with pp_schedule={p.pp_schedule!r} splits the model into {stages} "
                f"stages, which must divide num_hidden_layers ({m.num_hidden_layers}); choose pp so that "
                f"pp{' x 2' if stages > p.pp else ''} divides {m.num_hidden_layers}"
            )
    if batch_invariant:
        check_batch_invariant(p)
    multiple = sequence_multiple(p)
    if seq_len is not None and seq_len % multiple:
        why = f"2 x cp={p.cp} chunks for load-balanced causal ring attention" if p.cp > 1 else ""
        if p.sequence_parallel and p.tp > 1:
            why += (" times " if why else "") + f"tp={p.tp} sequence-parallel pieces"
        raise ConfigError(
            f"sequence length {seq_len} must be a multiple of {multiple} ({why}); pad it to "
            f"{-(-seq_len // multiple) * multiple} or change train.parallel.cp / tp"
        )


def check_expert_parallel(parallel: ParallelConfig, model_config: DecoderConfig) -> None:
    """Raises ConfigError unless train.parallel.ep > 1 follows the rule expert parallelism implements.

    ep borrows its ranks (the world size does not count it): with tp > 1 they are the tp ranks
    (ep == tp, with sequence_parallel so each tp rank routes its own tokens), otherwise ep
    neighbouring dp_shard ranks (ep divides dp_shard). ep must divide num_experts; cp and pp
    are not combined with it yet.
    """
    p = parallel
    experts = getattr(model_config, "num_experts", 0)
    if not experts:
        raise ConfigError(
            f"train.parallel.ep={p.ep}: expert parallelism needs a mixture-of-experts model, and "
            f"{type(model_config).__name__} is dense; set train.parallel.ep=1"
        )
    if experts % p.ep:
        raise ConfigError(
            f"train.parallel.ep={p.ep} must divide the model's num_experts ({experts}): each ep rank holds "
            f"an equal share of every sparse layer's experts; pick ep from {_divisors(experts)}"
        )
    if p.cp > 1 or p.pp > 1:
        raise ConfigError(
            f"train.parallel.ep={p.ep} with cp={p.cp}, pp={p.pp}: expert parallelism is implemented with "
            f"dp_shard, dp_replicate and tp only; set train.parallel.cp=1 and pp=1, or ep=1"
        )
    if p.tp > 1:
        if p.ep != p.tp or not p.sequence_parallel:
            raise ConfigError(
                f"train.parallel.ep={p.ep} with tp={p.tp} (sequence_parallel={p.sequence_parallel}): with "
                f"tensor parallelism the ep ranks are the tp ranks, each routing its sequence-parallel share "
                f"of the tokens; set train.parallel.ep={p.tp} and sequence_parallel=true, or tp=1"
            )
    elif p.dp_shard % p.ep:
        raise ConfigError(
            f"train.parallel.ep={p.ep} must divide train.parallel.dp_shard ({p.dp_shard}): the ep ranks are "
            f"borrowed from dp_shard (the world size does not count ep); pick ep from "
            f"{[d for d in _divisors(p.dp_shard) if experts % d == 0]} or raise dp_shard"
        )


def check_batch_invariant(parallel: ParallelConfig) -> None:
    """Raises ConfigError when batch-invariant mode cannot give the generator's bits under `parallel`.

    Data parallelism and pipeline stages only change which rows share a kernel call, and every
    batch-invariant kernel's per-row bits do not depend on that; tensor and context parallelism
    change the order of a token's own reductions, which the kernels cannot undo.
    """
    p = parallel
    if p.tp > 1 or p.cp > 1:
        raise ConfigError(
            f"batch_invariant=True cannot run with train.parallel tp={p.tp}, cp={p.cp}: tensor parallelism "
            f"sums row-parallel partial products across ranks and context parallelism's ring attention "
            f"merges per-chunk softmax results, both in another order than the single-process generator's "
            f"kernels, so the trainer's logprobs could not match vLLM's bits. Set train.parallel.tp=1 and "
            f"cp=1 and split the trainer with dp_shard / dp_replicate / pp instead (bitwise equal to one "
            f"process), or set batch_invariant=False"
        )


def check_compile(train: TrainConfig, batch_invariant: bool, device: str | None = None) -> None:
    """Raises ConfigError for a train.compute.compile=True the trainer cannot honour (validation, and the
    trainer itself when built from Python). device: the trainer's resolved device (default train.compute.device)."""
    if not train.compute.compile:
        return
    if batch_invariant:
        raise ConfigError("train.compute.compile=True with batch_invariant=True: inductor's fused kernels would "
                          "replace the batch-invariant ones the generator's bits depend on. Set one of them to False")
    if (device or train.compute.device) == "xla":
        raise ConfigError("train.compute.compile=True with train.compute.device='xla': the XLA trainer compiles "
                          "each step itself; set train.compute.compile=False")
    p = train.parallel
    if p.world_size > 1 or p.ep > 1:
        degrees = ", ".join(f"{d}={getattr(p, d)}" for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
                            if getattr(p, d) > 1)
        raise ConfigError(f"train.compute.compile=True is checked with the single-process trainer only, not yet with "
                          f"train.parallel {degrees}: set train.compute.compile=False, or train.parallel to one "
                          "process")


def check_idle_threads(train: TrainConfig, batch_invariant: bool, device: str | None = None) -> None:
    """Raises ConfigError for a train.compute.threads_when_rollouts_idle the trainer cannot honour.
    device: the trainer's resolved device (default train.compute.device; 'auto' may still become CUDA,
    where the trainer ignores the setting)."""
    idle = train.compute.threads_when_rollouts_idle
    if idle is None:
        return
    if idle < train.compute.threads:
        raise ConfigError(
            f"train.compute.threads_when_rollouts_idle={idle} is below "
            f"train.compute.threads={train.compute.threads}: it is "
            "the count for when the workers' cores are free too, so set it >= train.compute.threads"
        )
    if batch_invariant:
        raise ConfigError(
            "train.compute.threads_when_rollouts_idle with batch_invariant=True: a thread count that follows "
            "the workers' timing changes the trainer's float rounding. Unset one of them"
        )
    where = device or train.compute.device
    if where in ("cuda", "xla"):
        raise ConfigError(
            f"train.compute.threads_when_rollouts_idle shares CPU cores with the rollout workers; the trainer "
            f"runs on train.compute.device={where!r}: unset it"
        )
    p = train.parallel
    if p.world_size > 1 or p.ep > 1:
        raise ConfigError(
            "train.compute.threads_when_rollouts_idle is implemented for the single-process trainer, not for "
            "a parallel train.parallel layout: unset it, or train.parallel to one process"
        )


def uses_onednn_linears(train: TrainConfig, batch_invariant: bool, device: str, dtype: str) -> bool:
    """Whether the trainer's linear layers run through oneDNN (train.compute.cpu_matmul, resolved here);
    raises ConfigError for an explicit 'onednn' the trainer cannot honour. device: the trainer's
    resolved device; dtype: its compute dtype."""
    from titanrl.kernels.onednn_linear import onednn_available, onednn_is_faster_here

    if train.compute.cpu_matmul == "mkl":
        return False
    p = train.parallel
    refusal = None
    if batch_invariant:
        refusal = "batch_invariant=True runs its own batch-invariant kernels"
    elif device != "cpu":
        refusal = f"the trainer runs on train.compute.device={device!r}, not the CPU"
    elif p.world_size > 1 or p.ep > 1:
        refusal = "it is implemented for the single-process trainer, not a parallel train.parallel layout"
    elif dtype != "float32":
        refusal = f"the trainer computes in {dtype}; it is measured for float32 only"
    elif not onednn_available():
        refusal = "this torch has no oneDNN (torch.backends.mkldnn is unavailable)"
    if train.compute.cpu_matmul == "onednn" and refusal:
        raise ConfigError(
            f"train.compute.cpu_matmul='onednn' cannot apply: {refusal}. Set train.compute.cpu_matmul='auto' or 'mkl'"
        )
    return refusal is None and (train.compute.cpu_matmul == "onednn" or onednn_is_faster_here())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
