"""`titanrl plan`: per-rank memory of every candidate layout for N GPUs, and the one to use.

The estimates are titanrl.planning's (formulas documented there); this module only reads the
arguments and formats the table or the JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from titanrl.commands import CommandError
from titanrl.planning.layouts import RULE, Candidate, Plan, plan, what_would_fit
from titanrl.planning.memory import GiB, Workload
from titanrl.planning.shape import ModelShape, PlanInputError
from titanrl.trainer.logprob_chunks import chunk_tokens_for

COLUMNS = (
    ("layout", 38), ("params", 7), ("grads", 7), ("optim", 7), ("fsdp", 7), ("act:none", 9), ("act:full", 9),
    ("logit:full", 11), ("logit:chunk", 12), ("peak", 7), ("comm GB", 8), ("bubble", 7), ("fits", 4),
)


def plan_command(model: str, gpus: int, gpu_memory: float, seq_len: int, batch: int, *, dtype: str = "float32",
                 compute_dtype: str | None = None, micro_batch: int = 64, activation_checkpointing: str = "none",
                 logprob_chunk_tokens: int | None = None, kl_reference: bool = False, margin: float = 0.1,
                 top: int | None = None, as_json: bool = False) -> tuple[str, bool]:
    """The report (table or JSON) and whether a layout fits. Raises CommandError on bad input."""
    try:
        shape = ModelShape.from_config_json(model)
        work = Workload(seq_len=seq_len, batch=batch, micro_batch=micro_batch, dtype=dtype,
                        compute_dtype=compute_dtype or dtype, activation_checkpointing=activation_checkpointing,
                        logprob_chunk_tokens=logprob_chunk_tokens, kl_reference=kl_reference)
        result = plan(shape, gpus, gpu_memory, work, margin)
        hints = [] if result.recommended else what_would_fit(shape, gpus, gpu_memory, work, margin)
        if result.recommended and work.activation_checkpointing == "none":
            other = plan(shape, gpus, gpu_memory, replace(work, activation_checkpointing="full"), margin).recommended
            if other and other.comm.total < result.recommended.comm.total:
                hints.append(
                    f"with --activation-checkpointing full (each block's forward runs twice: about 1/3 more "
                    f"compute) {other.layout.short()} fits (peak {other.memory.peak / GiB:.1f} GiB) and sends "
                    f"{other.comm.total / 1e9:.1f} GB per rank per step instead of {result.recommended.comm.total / 1e9:.1f}"
                )
    except (PlanInputError, ValueError) as e:
        raise CommandError(str(e)) from e
    text = _json(result, hints, top) if as_json else _table(result, hints, top)
    return text, result.recommended is not None


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _row(c: Candidate) -> list[str]:
    m, comm = c.memory, c.comm
    return [
        c.layout.short() + (f" (stage {m.stage})" if c.layout.pp > 1 else ""),
        _gib(m.parameters + m.master_weights + m.reference), _gib(m.gradients), _gib(m.optimizer_state),
        _gib(m.fsdp_buffers + m.gradient_accumulation),
        _gib(m.activations_stored), _gib(m.activations_checkpointed), _gib(m.logits_full), _gib(m.logits_chunked),
        _gib(m.peak), f"{comm.total / 1e9:.1f}", f"{comm.bubble:.0%}", "yes" if c.fits else "no",
    ]


def _table(p: Plan, hints: list[str], top: int | None) -> str:
    w = p.work
    chunk = chunk_tokens_for(p.shape.vocab_size, w.logprob_chunk_tokens or None)  # tp splits the vocabulary
    lines = [
        p.shape.describe(),
        f"{p.gpus} GPUs x {p.gpu_memory / GiB:g} GiB: budget {p.budget / GiB:.1f} GiB per GPU after a {p.margin:.0%} "
        f"safety margin. Step: {w.batch} sequences x {w.seq_len} tokens, micro-batch {w.micro_batch} per "
        f"data-parallel rank. Parameters stored in {w.dtype}, compute in {w.compute_dtype}.",
        f"The peak uses act:{w.activation_checkpointing} (--activation-checkpointing) and "
        + (f"logit:chunk of {chunk} tokens at tp=1 (--logprob-chunk-tokens)." if w.logprob_chunk_tokens != 0
           else "logit:full (--logprob-chunk-tokens 0); logit:chunk shows the trainer's default chunks."),
        "",
        "GiB on the busiest rank of each layout; comm: GB that rank sends per step; bubble: pipeline idle share.",
        "params: stored shards (+ float32 master copy, + the KL reference's shards with --kl-reference);",
        "grads: float32 shards; optim: AdamW's two float32 moments;",
        "fsdp: gathered compute-dtype units, unsharded gradients and their accumulation over micro-batches;",
        "peak: params + grads + optim + max(fsdp + act + logit (+ a later micro-batch's embedding and head",
        "gradients beside .grad, without FSDP), AdamW step temporaries) + CUDA context (1 GiB).",
        "",
    ]
    rows = [[name for name, _ in COLUMNS]] + [_row(c) for c in p.candidates[:top]]
    for r in rows:
        lines.append("  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                               for i, (cell, (_, width)) in enumerate(zip(r, COLUMNS, strict=True))).rstrip())
    if top is not None and len(p.candidates) > top:
        lines.append(f"... {len(p.candidates) - top} more layouts (--top shows more)")
    lines.append("")
    lines.append(RULE + ".")
    rec = p.recommended
    if rec is None:
        best = min(p.candidates, key=lambda c: c.memory.peak)
        lines.append(
            f"NOTHING FITS: the smallest peak is {best.memory.peak / GiB:.1f} GiB ({best.layout.short()}) against a "
            f"budget of {p.budget / GiB:.1f} GiB."
        )
        lines.extend(f"  {h}" for h in hints)
        lines.append("  or: more GPUs (--gpus), GPUs with more memory (--gpu-memory), a shorter --seq-len.")
    else:
        m = rec.memory
        lines.append(
            f"RECOMMENDED: {rec.layout.short()}: peak {m.peak / GiB:.1f} GiB of {p.budget / GiB:.1f}, "
            f"{rec.comm.total / 1e9:.1f} GB sent per rank per step, {m.schedule.micro_batches} micro-batch(es) of "
            f"{m.schedule.rows_per_micro_batch} sequence(s) per data-parallel rank."
        )
        lines.append(f"  titanrl train CONFIG.py {rec.layout.overrides()}")
        lines.extend(f"Also: {h}." for h in hints)
    return "\n".join(lines)


def _candidate_dict(c: Candidate) -> dict:
    return {"layout": asdict(c.layout), "fits": c.fits, "memory": c.memory.as_dict(), "communication": c.comm.as_dict()}


def _json(p: Plan, hints: list[str], top: int | None) -> str:
    out = {
        "model": {**asdict(p.shape), "total_params": p.shape.total_params, "active_params": p.shape.active_params},
        "workload": asdict(p.work),
        "gpus": p.gpus, "gpu_memory_bytes": p.gpu_memory, "margin": p.margin, "budget_bytes": p.budget,
        "rule": RULE,
        "recommended": _candidate_dict(p.recommended) if p.recommended else None,
        "candidates": [_candidate_dict(c) for c in p.candidates[:top]],
        "hints": hints,
    }
    for c in out["candidates"] + ([out["recommended"]] if out["recommended"] else []):
        c["memory"].pop("layout")  # already under "layout"
    return json.dumps(out, indent=1)
