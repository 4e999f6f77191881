"""Checks a parallel layout against the single-process trainer: same batch, same loss and gradients.

    python -m support.layout_check fsdp tp_sp pp ...   (one JSON line per layout)

`reference` runs GRPOTrainer.accumulate_gradients (and its optimizer step) in this process;
`check_layouts` runs GRPOStep under each layout inside a torch.distributed world and
compares the global loss and the full gathered gradient with the reference. Used by
benchmarks/parallel_layouts.py and tests/test_parallel_*.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titanrl.config.unplanned import concrete_memory
from titanrl.config.schema import ModelConfig, ParallelConfig, TrainConfig
from titanrl.config import LossConfig, MemoryConfig, OptimizerConfig
from titanrl.models.hf_checkpoint import load_model
from titanrl.models.qwen3.moe import Qwen3MoeConfig
from titanrl.models.tiny import tiny_config, write_checkpoint, write_tiny_checkpoint
from titanrl.trainer.grpo import token_logprobs
from titanrl.trainer.parallel.gather import iter_full_gradients, iter_full_weights
from titanrl.trainer.parallel.mesh import build_mesh
from titanrl.trainer.optimizer import build_optimizers
from titanrl.trainer.parallel.parallelize import parallelize
from titanrl.trainer.step import GRPOStep
from titanrl.trainer.parallel.tied import tied_copies_equal
from titanrl.config.parallel import validate_parallel
from titanrl.trainer.batch import PackedBatch, pack
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.truncation import Truncation
from titanrl.types import Group, Sample
from titanrl.trainer.setup import TrainerSetup

LAYOUTS: dict[str, dict[str, Any]] = {
    # 2 processes
    "fsdp": dict(dp_shard=2),
    "ddp": dict(dp_replicate=2),
    "tp": dict(tp=2),
    "tp_sp": dict(tp=2, sequence_parallel=True),
    "pp": dict(pp=2, pp_schedule="1F1B"),
    "pp_gpipe": dict(pp=2, pp_schedule="GPipe"),
    "pp_interleaved": dict(pp=2, pp_schedule="Interleaved1F1B"),
    "cp": dict(cp=2),
    # 4 processes
    "hsdp": dict(dp_replicate=2, dp_shard=2),
    "fsdp+tp": dict(dp_shard=2, tp=2),
    "fsdp+tp_sp": dict(dp_shard=2, tp=2, sequence_parallel=True),
    "fsdp+cp": dict(dp_shard=2, cp=2),
    "cp+tp_sp": dict(cp=2, tp=2, sequence_parallel=True),
    "pp+fsdp": dict(pp=2, dp_shard=2),
    "pp+tp": dict(pp=2, tp=2),
    "pp+cp": dict(pp=2, cp=2),
    "cp4": dict(cp=4),
    "pp4": dict(pp=4, pp_schedule="1F1B"),  # 1 layer per stage; tied: middle stages hold no copy
    # Expert parallelism (a mixture-of-experts policy; ep borrows ranks)
    "ep": dict(dp_shard=2, ep=2),
    "tp_sp+ep": dict(tp=2, sequence_parallel=True, ep=2),
    "fsdp+ep": dict(dp_shard=4, ep=2),  # 4 processes
    "ep4": dict(dp_shard=4, ep=4),
    "hsdp+ep": dict(dp_replicate=2, dp_shard=2, ep=2),
    "fsdp+tp_sp+ep": dict(dp_shard=2, tp=2, sequence_parallel=True, ep=2),
}
"""Named layouts; each runs with exactly ParallelConfig(**kwargs).world_size processes."""

EXPERT_PARALLEL = [name for name, kw in LAYOUTS.items() if kw.get("ep", 1) > 1]
"""Layouts that need a mixture-of-experts policy (make_case(moe=True))."""

TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, std=0.1)
"""A ~0.1M-parameter Qwen3 with 4 layers (Interleaved1F1B over pp=2 needs 4 stages) and GQA."""

FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {"qwen3": {}, "llama": dict(attention_bias=True, mlp_bias=True),
                                               "qwen2": {}}
"""Dense families a case can use (`make_case(family=...)`) and their config fields on TINY_MODEL:
Llama with biases on every projection (q/k/v/o and gate/up/down), so tensor parallelism shards
and replicates biases too; Qwen2's q/k/v biases come with the family (no q/k norms in either)."""

TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
"""Qwen3-MoE on TINY_MODEL: layers 1-3 route each token to 2 of 4 experts (layer 0 stays dense)."""

TINY_MOE_STD = 0.2
"""Init std of the MoE policy: router scores spread enough that tokens take different experts."""


def write_tiny_moe_checkpoint(out_dir: str | Path, seed: int = 0, tied: bool = False) -> Path:
    """TINY_MODEL with TINY_MOE's experts, as an HF checkpoint (byte tokenizer)."""
    base = tiny_config(tie_word_embeddings=tied, **{k: v for k, v in TINY_MODEL.items() if k != "std"})
    config = Qwen3MoeConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **TINY_MOE)
    return write_checkpoint(out_dir, config, seed=seed, std=TINY_MOE_STD)


@dataclass
class Case:
    """One GRPO batch to check layouts on."""

    checkpoint: str
    """HF checkpoint directory of the policy."""
    batch: PackedBatch
    """The packed batch every layout (and the reference) trains on."""
    train: TrainConfig
    """Loss / micro-batching / optimizer settings."""
    temperature: float = 1.0
    """Sampling temperature the trainer scores under."""
    tied: bool = False
    """Whether the policy ties its embedding and LM head."""
    moe: bool = False
    """Whether the policy is the tiny mixture of experts (TINY_MOE)."""
    family: str = "qwen3"
    """The dense model family of the policy (FAMILY_OVERRIDES)."""
    truncation: Truncation | None = None
    """Top-k / top-p the trainer scores under (None: the full softmax)."""


@dataclass
class Reference:
    """What the single-process GRPOTrainer computed on the case."""

    loss: float
    """Token-mean loss."""
    grads: dict[str, torch.Tensor]
    """Gradient of every HF-named parameter (tied head omitted)."""
    grad_norm: float
    """Global gradient L2 norm before clipping."""
    update: dict[str, torch.Tensor]
    """Parameter change made by the first optimizer step (clipped AdamW)."""
    stats: dict[str, float] = field(default_factory=dict)
    """GradStats fields."""
    step_s: float = 0.0
    """Wall time of accumulate_gradients + optimizer step."""
    warm_step_s: float = 0.0
    """Wall time of a second step on the same batch."""


def make_case(workdir: str | Path, *, tied: bool = False, moe: bool = False, groups: int = 4, group_size: int = 4,
              micro_batch_size: int = 3, seed: int = 0, family: str = "qwen3") -> Case:
    """A tiny policy and a batch of random groups: varied lengths, env-inserted tokens, noisy
    generator logprobs (so some ratios clip), micro-batches that split unevenly.
    moe: the policy is TINY_MOE's mixture of experts (Qwen3-MoE); family: a dense family of
    FAMILY_OVERRIDES (TINY_MODEL's shape with that family's fields)."""
    if family not in FAMILY_OVERRIDES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILY_OVERRIDES)}")
    if moe and family != "qwen3":
        raise ValueError(f"moe=True is the tiny Qwen3-MoE policy; family={family!r} has no mixture of experts")
    name = ("moe_" if moe else "") + ("" if family == "qwen3" else f"{family}_") + ("tied" if tied else "untied")
    if moe:
        ckpt = write_tiny_moe_checkpoint(Path(workdir) / name, seed=seed, tied=tied)
    elif family == "qwen3":
        ckpt = write_tiny_checkpoint(Path(workdir) / name, seed=seed, tie_word_embeddings=tied, **TINY_MODEL)
    else:
        shape = {k: v for k, v in TINY_MODEL.items() if k != "std"}
        config = tiny_config(family, tie_word_embeddings=tied, **shape, **FAMILY_OVERRIDES[family])
        ckpt = write_checkpoint(Path(workdir) / name, config, seed=seed, std=TINY_MODEL["std"])
    model, config = load_model(ckpt)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out: list[Group] = []
    for g in range(groups):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 10))]
        samples = []
        for _ in range(group_size):
            completion = [rng.randrange(256) for _ in range(rng.randint(1, 14))]
            seq = torch.tensor([prompt + completion])
            with torch.no_grad():
                lp = token_logprobs(model(seq[:, :-1]), seq[:, 1:])[0, len(prompt) - 1:]
            noisy = (lp + 0.3 * torch.randn(lp.shape, generator=gen)).tolist()
            mask = [0 if rng.random() < 0.15 else 1 for _ in completion] if rng.random() < 0.5 else None
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=noisy, reward=rng.random(), group_id=g, policy_version=0,
                                  loss_mask=mask))
        out.append(Group(samples))
    batch = pack(out, pad_id=config.eos_token_id or 0, current_version=0)
    train = TrainConfig(
        memory=MemoryConfig(micro_batch_size=micro_batch_size),
        optimizer=OptimizerConfig(lr=1e-3, grad_clip=1.0),
        loss=LossConfig(clip_eps=0.2),
    )
    return Case(str(ckpt), batch, train, tied=tied, moe=moe, family=family)


def reference(case: Case) -> Reference:
    """GRPOTrainer's loss and gradients on the case (one process, one thread)."""
    trainer = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=case.checkpoint), case.train, case.temperature, seed=0, truncation=case.truncation
        )
    )
    t0 = time.perf_counter()
    stats = trainer.accumulate_gradients(case.batch)
    t1 = time.perf_counter()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    t2 = time.perf_counter()
    trainer.optimizer_step(stats)
    step_s = (t1 - t0) + (time.perf_counter() - t2)
    update = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
    t3 = time.perf_counter()
    trainer.optimizer_step(trainer.accumulate_gradients(case.batch))
    warm_s = time.perf_counter() - t3
    return Reference(stats.loss_sum / stats.tokens, grads, norm, update, vars(stats).copy(), step_s, warm_s)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def check_layout(name: str, case: Case, ref: Reference, device_type: str = "cpu") -> dict[str, Any] | None:
    """Runs one GRPOStep under LAYOUTS[name] (call on every rank); rank 0 returns the report.

    Report: loss_rel_diff = |loss - ref| / |ref|; grad_rel_diff = ||g - g_ref|| / ||g_ref|| over
    all parameters concatenated (relative L2); grad_max_param_rel_diff = the largest per-parameter
    relative L2; grad_norm_rel_diff for the distributed norm; entropy_sum_rel_diff for the summed
    entropy of the trained tokens (counted once over tp / pp ranks); update_rel_diff for the parameter
    change of the first (clipped AdamW) step, gathered with iter_full_weights; step_s = slowest
    rank's wall time of accumulate_gradients + clip_and_step (first step, cold); warm_step_s =
    the same for a second step on the batch; tied_copies_equal = whether, after those two steps,
    the first and last pipeline stages' copies of a tied embedding are bitwise equal (None when
    the layout does not split one).
    """
    parallel = ParallelConfig(**LAYOUTS[name])
    model, config = load_model(case.checkpoint)
    validate_parallel(parallel, config, dist.get_world_size())
    mesh = build_mesh(parallel, device_type)
    compute = case.train.compute.dtype  # mixed precision as GRPOTrainer sets it up (None: parameters' dtype)
    pm = parallelize(model, parallel, mesh, activation_checkpointing=concrete_memory(case.train.memory).activation_checkpointing,
                     activation_checkpointing_every=case.train.memory.activation_checkpointing_every,
                     compute_dtype=getattr(torch, compute) if compute else None)
    optimizers = build_optimizers(pm, case.train)
    step = GRPOStep(pm, optimizers, case.train, case.temperature, truncation=case.truncation)
    dist.barrier()
    t0 = time.perf_counter()
    stats = step.accumulate_gradients(case.batch)
    t1 = time.perf_counter()
    grads = {n: g.clone() for bucket in iter_full_gradients(pm, bucket_bytes=1 << 20) for n, g in bucket}
    norm = step.grad_norm()
    t2 = time.perf_counter()
    step.clip_and_step(stats)
    first_s = (t1 - t0) + (time.perf_counter() - t2)
    # Every rank takes part in the gathers; rank 0 receives.
    weights = {n: w.clone() for bucket in iter_full_weights(pm, bucket_bytes=1 << 20) for n, w in bucket}
    t3 = time.perf_counter()
    step.clip_and_step(step.accumulate_gradients(case.batch))  # warm: DTensor / pipeline set-up cached
    elapsed = torch.tensor([first_s, time.perf_counter() - t3], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    # After two optimizer steps: a tied matrix split across pipeline stages has equal copies.
    copies_equal = tied_copies_equal(pm.parts, pm.tied_group, pm.device) if pm.split_tied else None
    if dist.get_rank() != 0:
        return None
    names = sorted(ref.grads)
    if sorted(grads) != names or sorted(weights) != names:
        raise AssertionError(f"{name}: gathered names differ from the reference's: {sorted(grads)} vs {names}")
    loss = stats.loss_sum / stats.tokens
    initial = dict(load_model(case.checkpoint)[0].named_parameters())
    update = torch.cat([(weights[n].cpu() - initial[n].detach()).flatten() for n in names])
    flat = torch.cat([grads[n].flatten().cpu() for n in names])
    flat_ref = torch.cat([ref.grads[n].flatten() for n in names])
    return {
        "layout": name,
        "world_size": parallel.world_size,
        "parallel": LAYOUTS[name],
        "tied_embeddings": case.tied,
        "moe": case.moe,
        "family": case.family,
        "tied_copies_equal": copies_equal,
        "loss_rel_diff": abs(loss - ref.loss) / abs(ref.loss),
        "grad_rel_diff": _rel(flat, flat_ref),
        "grad_max_param_rel_diff": max(_rel(grads[n].cpu(), ref.grads[n]) for n in names),
        "grad_norm_rel_diff": abs(norm - ref.grad_norm) / ref.grad_norm,
        "update_rel_diff": _rel(update, torch.cat([ref.update[n].flatten() for n in names])),
        "clipped_tokens_equal": stats.clipped_tokens == ref.stats["clipped_tokens"],
        "entropy_sum_rel_diff": abs(stats.entropy_sum - ref.stats["entropy_sum"]) / ref.stats["entropy_sum"],
        "logprob_diff_sum_rel_diff": abs(stats.abs_logprob_diff_sum - ref.stats["abs_logprob_diff_sum"])
        / ref.stats["abs_logprob_diff_sum"],
        "parity_tokens_equal": stats.parity.checked == ref.stats["parity"].checked > 0,
        "truncation_outside_equal": stats.truncation_outside_tokens == ref.stats["truncation_outside_tokens"],
        "step_s": round(elapsed[0].item(), 4),
        "warm_step_s": round(elapsed[1].item(), 4),
        "ref_step_s": round(ref.step_s, 4),
        "ref_warm_step_s": round(ref.warm_step_s, 4),
    }


def check_layouts(rank: int, world_size: int, names: list[str], case: Case, ref: Reference) -> list[dict]:
    """World entry point (see launch.run_local_world): every layout in `names` in turn."""
    reports = [check_layout(name, case, ref) for name in names]
    return [r for r in reports if r is not None]


def main(argv: list[str] | None = None) -> None:
    from titanrl.trainer.parallel.launch import run_local_world

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layouts", nargs="*", help=f"from {sorted(LAYOUTS)} (default: all that fit the policy)")
    parser.add_argument("--tied", action="store_true", help="tied embedding / LM head")
    parser.add_argument("--moe", action="store_true", help="the tiny mixture-of-experts policy (ep layouts need it)")
    parser.add_argument("--family", default="qwen3", choices=list(FAMILY_OVERRIDES), help="dense model family")
    args = parser.parse_args(argv)
    args.layouts = args.layouts or [n for n in LAYOUTS if args.moe or n not in EXPERT_PARALLEL]
    with tempfile.TemporaryDirectory() as tmp:
        case = make_case(tmp, tied=args.tied, moe=args.moe, family=args.family)
        ref = reference(case)
        by_world: dict[int, list[str]] = {}
        for name in args.layouts:
            by_world.setdefault(ParallelConfig(**LAYOUTS[name]).world_size, []).append(name)
        for world, names in sorted(by_world.items()):
            for report in run_local_world(check_layouts, world, names, case, ref)[0]:
                print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
