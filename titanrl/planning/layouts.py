"""Candidate layouts for N GPUs, their estimates, and the recommended one.

Candidates are the layouts the trainer accepts: dp_shard x tp x pp x cp = N (dp_replicate = 1:
HSDP only moves traffic between links, which these byte counts do not see), checked by
`titanrl.config.parallel.validate_parallel` (tp divides the heads and MLP width, pp the layers,
the sequence splits into 2 x cp (x tp) pieces), every data-parallel rank gets at least one row,
and for an MoE model every ep the trainer implements (ep divides the expert count and borrows
its ranks: ep == tp when tp > 1, else ep divides dp_shard; not with cp or pp, see
`titanrl.config.parallel.check_expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titanrl.config.parallel import validate_parallel
from titanrl.config.schema import ParallelConfig
from titanrl.errors import ConfigError
from titanrl.planning.communication import Communication, communication
from titanrl.planning.memory import GiB, Layout, MemoryEstimate, Workload, estimate
from titanrl.planning.shape import ModelShape, PlanInputError

MAX_BUBBLE = 0.25
"""Pipeline bubbles above this are only recommended when nothing else fits."""

RULE = (
    "recommended: among the layouts whose peak fits in (1 - margin) x GPU memory, the one that sends "
    "the fewest bytes per rank per step (FSDP gathers + reduce-scatters, TP/SP collectives, CP ring, "
    f"PP sends, EP all-to-all; column comm); layouts whose pipeline bubble exceeds {MAX_BUBBLE:.0%} only "
    "when nothing else fits; ties go to fewer model-parallel ranks (tp x pp x cp), then smaller ep"
)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    comm: Communication
    fits: bool

    def sort_key(self) -> tuple:
        lay = self.layout
        return (self.comm.bubble > MAX_BUBBLE, self.comm.total, lay.tp * lay.pp * lay.cp, lay.ep)


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    work: Workload
    gpus: int
    gpu_memory: int
    """Bytes per GPU."""
    margin: float
    candidates: list[Candidate]
    """Fitting ones first in order of preference, then the rest by peak."""
    recommended: Candidate | None

    @property
    def budget(self) -> int:
        return int(self.gpu_memory * (1 - self.margin))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(shape: ModelShape, gpus: int, work: Workload) -> list[Layout]:
    if gpus < 1:
        raise PlanInputError(f"--gpus must be a positive number of GPUs, got {gpus}")
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                dp_shard = gpus // (tp * pp * cp)
                if dp_shard > work.batch:
                    continue  # a data-parallel rank with no row
                layout = Layout(dp_shard=dp_shard, tp=tp, pp=pp, cp=cp)
                eps = [e for e in _divisors(dp_shard * cp * tp) if shape.num_experts % e == 0] if shape.is_moe else [1]
                out.extend(replace(layout, ep=ep) for ep in eps if _accepted(replace(layout, ep=ep), shape, work))
    return out


def _accepted(layout: Layout, shape: ModelShape, work: Workload) -> bool:
    """Whether the trainer takes `layout` for this model (validate_parallel, ep's rule included)."""
    try:
        validate_parallel(
            ParallelConfig(dp_shard=layout.dp_shard, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                           sequence_parallel=layout.tp > 1, pp_schedule=layout.pp_schedule),
            shape, world_size=None, seq_len=work.seq_len,  # type: ignore[arg-type]
        )
    except ConfigError:
        return False
    return True


def plan(shape: ModelShape, gpus: int, gpu_memory_gib: float, work: Workload, margin: float = 0.1) -> Plan:
    """Every candidate's estimate and communication, and the recommended layout (None: nothing fits)."""
    if gpu_memory_gib <= 0:
        raise PlanInputError(f"--gpu-memory must be positive GiB, got {gpu_memory_gib}")
    if not 0 <= margin < 1:
        raise PlanInputError(f"--safety-margin must be in [0, 1), got {margin}")
    gpu_memory = int(gpu_memory_gib * GiB)
    budget = int(gpu_memory * (1 - margin))
    layouts = candidate_layouts(shape, gpus, work)
    if not layouts:
        raise PlanInputError(
            f"no layout of {gpus} GPUs can run this model at --seq-len {work.seq_len} with --batch {work.batch}: "
            f"tp must divide {shape.num_attention_heads} heads / {shape.num_key_value_heads} KV heads, pp the "
            f"{shape.num_hidden_layers} layers, 2 x cp the sequence; change --gpus (e.g. a power of two) or --seq-len"
        )
    cands = []
    for layout in layouts:
        mem = estimate(shape, layout, work)
        cands.append(Candidate(layout, mem, communication(shape, layout, work), mem.peak <= budget))
    fitting = sorted((c for c in cands if c.fits), key=Candidate.sort_key)
    rest = sorted((c for c in cands if not c.fits), key=lambda c: c.memory.peak)
    return Plan(shape, work, gpus, gpu_memory, margin, fitting + rest, fitting[0] if fitting else None)


def what_would_fit(shape: ModelShape, gpus: int, gpu_memory_gib: float, work: Workload, margin: float) -> list[str]:
    """When nothing fits: the single settings changes that would make a layout fit; when none
    does, the first combination (in order of cost: checkpointing, chunking, bf16, smaller
    micro-batches) that does, or what even all of them leave."""
    changes: list[tuple[str, dict]] = []
    if work.activation_checkpointing == "none":
        changes.append(("--activation-checkpointing full", dict(activation_checkpointing="full")))
    if work.logprob_chunk_tokens == 0:
        changes.append(("--logprob-chunk-tokens 1024", dict(logprob_chunk_tokens=1024)))
    if work.compute_dtype == "float32":
        changes.append(("--compute-dtype bfloat16", dict(compute_dtype="bfloat16")))
    mb = work.micro_batch
    while mb > 1:
        mb //= 2
        changes.append((f"--micro-batch {mb}", dict(micro_batch=mb)))

    def fits(w: Workload) -> Candidate | None:
        return plan(shape, gpus, gpu_memory_gib, w, margin).recommended

    def said(c: Candidate) -> str:
        return f"fits as {c.layout.short()} (peak {c.memory.peak / GiB:.1f} GiB)"

    hints = []
    for label, change in changes:
        if label.startswith("--micro-batch") and hints:
            break
        c = fits(replace(work, **change))
        if c is not None:
            hints.append(f"{label}: {said(c)}")
            if label.startswith("--micro-batch"):
                break
    if hints:
        return hints
    combined, labels = work, []
    for label, change in changes:
        # a later --micro-batch replaces the earlier one
        labels = [x for x in labels if x.split()[0] != label.split()[0]] + [label]
        combined = replace(combined, **change)
        c = fits(combined)
        if c is not None:
            return [f"{' '.join(labels)}: {said(c)}"]
    p = plan(shape, gpus, gpu_memory_gib, combined, margin)
    best = min(p.candidates, key=lambda c: c.memory.peak)
    return [f"even {' '.join(labels)} leaves a peak of {best.memory.peak / GiB:.1f} GiB ({best.layout.short()})"]
