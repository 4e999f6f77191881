"""Functions that run inside gloo worlds for the tests: a file's own world (4 ranks, or a file that
starts its own) or the session's shared 2-rank `gloo_world` (tests/gloo_world.py). Starting
processes and importing torch costs ~10 s, so each world runs many checks."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titanrl.config.unplanned import concrete_memory
from titanrl import kernels
from titanrl.config import ParallelConfig
from titanrl.models.hf_checkpoint import load_model
from titanrl.models.qwen3 import CausalSDPA
from titanrl.trainer.parallel import build_mesh, iter_full_weights, load_model_optim, parallelize
from titanrl.trainer.step import GRPOStep
from support.sections import merged
from titanrl.trainer.optimizer import build_optimizers
from titanrl.trainer.parallel.checkpoint import save_training_checkpoint
from support.layout_check import Case, check_layout
from titanrl.trainer.parallel.ring_attention import ContextLayout, RingAttention
from titanrl.trainer.setup import TrainerSetup


def with_invariant_logprobs(case: Case) -> Case:
    """(Driver side, before a world starts.) The case with generator logprobs replaced by the single-process batch-invariant model's
    logprobs, computed on the whole padded batch at once (another batch shape than any step's)."""
    model, _ = load_model(case.checkpoint)
    model.set_batch_invariant(True)
    b = case.batch
    with torch.no_grad():
        logprobs = kernels.token_logprobs(model(b.input_ids_BT), b.targets_BT, case.temperature)
    old = torch.where(b.loss_mask_BT > 0, logprobs, torch.zeros_like(logprobs))
    batch = dataclasses.replace(b, old_logprobs_BT=old)
    return dataclasses.replace(case, batch=batch)


def with_lora_logprobs(case: Case, lora, b_seed: int) -> Case:
    """(Driver side.) The case with generator logprobs replaced by those of the single-process
    batch-invariant LoRA policy (`lora`, B set by `set_lora_b`), on the whole padded batch at once."""
    from titanrl.config import ModelConfig
    from titanrl.trainer.trainer import GRPOTrainer

    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=case.checkpoint), case.train, case.temperature, seed=0,
                                       lora=lora, batch_invariant=True))
    set_lora_b(trainer.pm.parts, b_seed)
    b = case.batch
    with torch.no_grad():
        logprobs = kernels.token_logprobs(trainer.model(b.input_ids_BT), b.targets_BT, case.temperature)
    old = torch.where(b.loss_mask_BT > 0, logprobs, torch.zeros_like(logprobs))
    return dataclasses.replace(case, batch=dataclasses.replace(b, old_logprobs_BT=old))


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, tuple]]) -> dict[str, Any]:
    """Runs each (function name in this module, args) in order on every rank; rank 0's results by job index."""
    out = {}
    for i, (fn, args) in enumerate(jobs):
        out[i] = globals()[fn](*args)
    return out


def layouts(names: list[str], case: Case, ref) -> dict[str, dict]:
    reports = {name: check_layout(name, case, ref) for name in names}
    return reports if dist.get_rank() == 0 else {}


def ring_attention(seq_per_rank: int = 8) -> dict[str, float]:
    """Max abs difference of RingAttention (output, dq, dk, dv) vs causal SDPA on the full sequence."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, D = 2, seq_per_rank * cp, 4, 2, 16
    q, k, v = (torch.randn(B, T, h, D, generator=gen, requires_grad=True) for h in (H, K, K))
    dout = torch.randn(B, T, H, D, generator=gen)
    ref = CausalSDPA(H, K, D)(q, k, v)
    ref.backward(dout)
    diffs = {}
    for balanced in (True, False):
        layout = ContextLayout(cp, rank, balanced)
        local = [layout.shard(t.detach(), 1).requires_grad_() for t in (q, k, v)]
        out = RingAttention(dist.group.WORLD, layout)(*local)
        out.backward(layout.shard(dout, 1))
        pairs = [(out, ref), *((t.grad, full.grad) for t, full in zip(local, (q, k, v), strict=True))]
        for what, (got, want) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
            key = f"{'balanced' if balanced else 'contiguous'}_{what}"
            diffs[key] = (got - layout.shard(want.detach(), 1)).abs().max().item()
    top = torch.tensor(list(diffs.values()))
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(zip(diffs, top.tolist(), strict=True))


def _setup(case: Case, layout: dict):
    parallel = ParallelConfig(**layout)
    model, _ = load_model(case.checkpoint)
    pm = parallelize(model, parallel, build_mesh(parallel, "cpu"),
                     activation_checkpointing=concrete_memory(case.train.memory).activation_checkpointing,
                     activation_checkpointing_every=case.train.memory.activation_checkpointing_every)
    optimizers = build_optimizers(pm, case.train)
    return pm, optimizers, GRPOStep(pm, optimizers, case.train, case.temperature)


def _loss(step: GRPOStep, case: Case) -> float:
    """Token-mean loss on the case's batch at the current weights (gradients dropped)."""
    stats = step.accumulate_gradients(case.batch)
    for opt in step.optimizers:
        opt.zero_grad(set_to_none=True)
    return stats.loss_sum / stats.tokens


def _full_weights(pm, bucket_bytes: int = 1 << 20) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Gathered weights on rank 0 and the byte size of each bucket (empty elsewhere)."""
    weights, sizes = {}, []
    for bucket in iter_full_weights(pm, bucket_bytes):
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        weights.update({n: t.detach().clone().cpu() for n, t in bucket})
    return weights, sizes


def publish(case: Case, layouts: dict[str, dict], bucket_bytes: int) -> dict[str, Any]:
    """Weights gathered by iter_full_weights right after parallelize, per layout, with bucket sizes."""
    out = {}
    for name, layout in layouts.items():
        pm, _, _ = _setup(case, layout)
        weights, sizes = _full_weights(pm, bucket_bytes)
        out[name] = {"names": list(weights), "weights": weights, "sizes": sizes, "rank": dist.get_rank()}
    return out


def resharding(case: Case, workdir: str, save_layout: dict, load_layouts: dict[str, dict],
               trainer_ckpt: str | None) -> dict[str, Any]:
    """Train one step under save_layout, save; load under each other layout (and GRPOTrainer's
    checkpoint under save_layout): weights, loss at load and loss after one more step."""
    out: dict[str, Any] = {}
    pm, opts, step = _setup(case, save_layout)
    step.clip_and_step(step.accumulate_gradients(case.batch))
    ckpt = Path(workdir) / "ckpt"
    save_training_checkpoint(pm, opts, ckpt, dtype=torch.float32, tokenizer_dir=case.checkpoint,
                             trainer_state={"version": 1, "optimizer_stepped": True})
    saved, _ = _full_weights(pm)
    loss_at_save = _loss(step, case)
    step.clip_and_step(step.accumulate_gradients(case.batch))
    out["saved"] = {"weights": saved, "loss": loss_at_save, "loss_after_step": _loss(step, case)}
    for name, layout in load_layouts.items():
        pm, opts, step = _setup(case, layout)
        load_model_optim(pm, opts, ckpt / "model_optim")
        weights, _ = _full_weights(pm)
        loss = _loss(step, case)
        step.clip_and_step(step.accumulate_gradients(case.batch))
        out[name] = {"weights": weights, "loss": loss, "loss_after_step": _loss(step, case)}
    if trainer_ckpt is not None:
        pm, opts, step = _setup(case, save_layout)
        load_model_optim(pm, opts, Path(trainer_ckpt) / "model_optim")
        loss = _loss(step, case)
        step.clip_and_step(step.accumulate_gradients(case.batch))
        out["from_trainer"] = {"loss": loss, "loss_after_step": _loss(step, case)}
    out["checkpoint"] = str(ckpt)
    return out if dist.get_rank() == 0 else {}


def batch_invariant(case: Case, layouts: dict[str, dict]) -> dict[str, dict[str, float]]:
    """GRPOStep(batch_invariant=True) per layout: the step's parity counts against the
    case's generator logprobs (tokens compared, tokens not bitwise equal)."""
    out = {}
    for name, layout in layouts.items():
        parallel = ParallelConfig(**layout)
        model, _ = load_model(case.checkpoint)
        pm = parallelize(model, parallel, build_mesh(parallel, "cpu"))
        step = GRPOStep(pm, build_optimizers(pm, case.train), case.train, case.temperature,
                                batch_invariant=True)
        stats = step.accumulate_gradients(case.batch)
        out[name] = {"checked": stats.parity.checked, "different": stats.parity.different,
                     "diff_max": stats.parity.diff_max, "loss": stats.loss_sum / stats.tokens}
    return out if dist.get_rank() == 0 else {}


def forward_parity(case: Case, layouts: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Per layout: GRPOStep.measure_parity (forward only) on fresh weights, whether every
    parameter's .grad is still None and every optimizer state empty after it (on all ranks), then
    the parity of a gradient pass at the same weights; parities as (diff_sum, diff_max, different,
    checked) and the wall time of each pass (slowest rank)."""
    out = {}
    for name, layout in layouts.items():
        pm, optimizers, step = _setup(case, layout)
        t0 = time.perf_counter()
        forward = step.measure_parity(case.batch)
        t1 = time.perf_counter()
        clean = all(p.grad is None for p in pm.parameters()) and not any(opt.state for opt in optimizers)
        dirty = torch.tensor([0.0 if clean else 1.0])
        dist.all_reduce(dirty)
        t2 = time.perf_counter()
        grad_pass = step.accumulate_gradients(case.batch).parity
        elapsed = torch.tensor([t1 - t0, time.perf_counter() - t2], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out[name] = {"forward": dataclasses.astuple(forward), "grad_pass": dataclasses.astuple(grad_pass),
                     "no_grads_or_state": dirty.item() == 0, "forward_s": elapsed[0].item(),
                     "grad_pass_s": elapsed[1].item()}
    return out if dist.get_rank() == 0 else {}


def tied_group_ranks(case: Case, layout: dict) -> list[list[int] | None]:
    """The global ranks of each rank's tied-embedding group (None: the rank is in none), by rank."""
    parallel = ParallelConfig(**layout)
    model, _ = load_model(case.checkpoint)
    group = parallelize(model, parallel, build_mesh(parallel, "cpu")).tied_group
    ranks: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, None if group is None else dist.get_process_group_ranks(group))
    return ranks


def vocab_parallel_logprobs(temperature: float = 0.7, chunk: int = 5) -> dict[str, float]:
    """chunked_token_logprobs over vocabulary shards (float64; uneven: 259 rows over the world, as a
    Shard(0) DTensor and as explicit shard + group + start) against the single-process Function on
    the whole head: max abs difference of logprobs, entropy, grad of hidden and of this rank's
    head rows (losses on both outputs), max over ranks; and the largest logits width any rank saw."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titanrl.trainer import chunked_logprobs
    from titanrl.trainer.chunked_logprobs import chunked_token_logprobs

    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    N, D, V = 23, 16, 259
    f64 = dict(generator=gen, dtype=torch.float64)  # float64: the combination's math, not float32 rounding
    hidden, weight = torch.randn(N, D, **f64), torch.randn(V, D, **f64)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[:4] = torch.tensor([0, V - 1, 129, 130])  # both ends of both shards
    g_lp, g_ent = torch.randn(N, **f64), torch.randn(N, **f64)

    def run(fn, w):
        h, w = hidden.clone().requires_grad_(), w
        lp, ent = fn(h, w)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad

    w_ref = weight.clone().requires_grad_()
    ref = run(lambda h, w: chunked_token_logprobs(h, w, targets, temperature, chunk), w_ref)
    mesh = init_device_mesh("cpu", (n,))
    widths: list[int] = []
    real_logits = chunked_logprobs._logits

    def spy(h, w, bi):  # records every logits chunk's width
        widths.append(w.shape[0])
        return real_logits(h, w, bi)

    chunked_logprobs._logits = spy
    try:
        w_dt = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        got = run(lambda h, w: chunked_token_logprobs(h, w, targets, temperature, chunk), w_dt)
        rows = w_dt.grad.to_local()
        start = min(rank * -(-V // n), V)
        w_local = weight[start:start + rows.shape[0]].clone().requires_grad_()
        explicit = run(lambda h, w: chunked_token_logprobs(h, w, targets, temperature, chunk,
                                                           vocab_group=mesh.get_group(), vocab_start=start), w_local)
    finally:
        chunked_logprobs._logits = real_logits
    want_rows = w_ref.grad[start:start + rows.shape[0]]
    diffs = {}
    for tag, res, g_rows in (("dtensor", got, rows), ("explicit", explicit, w_local.grad)):
        for what, a, b in zip(("logprobs", "entropy", "grad_hidden"), res, ref, strict=True):
            diffs[f"{tag}_{what}"] = (a - b).abs().max().item()
        diffs[f"{tag}_grad_weight_rows"] = (g_rows - want_rows).abs().max().item()
    diffs["max_logits_width"] = float(max(widths))
    top = torch.tensor(list(diffs.values()), dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return dict(zip(diffs, top.tolist(), strict=True))


def vocab_shards(cases: list[Case], layout: dict) -> list[dict[str, Any]]:
    """Per case, under `layout`: every rank's local row counts of the embedding and the LM head,
    whether the head is the embedding's parameter, and the vocabulary size."""
    out = []
    for case in cases:
        pm, _, _ = _setup(case, layout)
        (model,) = pm.parts
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        mine = [embed.to_local().shape[0], head.to_local().shape[0], float(head is embed)]
        rows: list[list[float] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        out.append({"rows": rows, "vocab": pm.config.vocab_size, "tied": case.tied})
    return out if dist.get_rank() == 0 else []


def _local_grads(pm) -> dict[str, torch.Tensor]:
    """This rank's gradient shard of every parameter (HF names; a pipeline rank's stages)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in pm.named_parameters() if p.grad is not None}


def activation_checkpointing_grads(case: Case, layouts: dict[str, dict], modes: dict[str, dict]) -> dict[str, Any]:
    """Per layout: one gradient accumulation without activation checkpointing and one per mode in
    `modes` (TrainConfig overrides); how many local gradient shards differ from the stored run's
    (torch.equal), summed over ranks, and whether the stored run's gradients are non-zero."""
    out = {}
    for name, layout in layouts.items():
        runs = {}
        for mode, overrides in {"none": {}, **modes}.items():
            mode_case = dataclasses.replace(case, train=merged(case.train, **overrides))
            pm, _, step = _setup(mode_case, layout)
            step.accumulate_gradients(case.batch)
            runs[mode] = _local_grads(pm)
        ref = runs.pop("none")
        nonzero = torch.tensor([float(any(g.abs().max() > 0 for g in ref.values() if g.numel()))])
        dist.all_reduce(nonzero)
        out[name] = {"nonzero": nonzero.item() == dist.get_world_size()}
        for mode, grads in runs.items():
            unequal = float(grads.keys() != ref.keys()) + sum(
                0.0 if torch.equal(grads[n], ref[n]) else 1.0 for n in ref if n in grads)
            count = torch.tensor([unequal])
            dist.all_reduce(count)
            out[name][mode] = {"unequal": int(count.item())}
    return out if dist.get_rank() == 0 else {}


def optimizer_groups_resume(case: Case, workdir: str, layout: dict) -> dict[str, Any]:
    """GRPOTrainer under `layout` (case.train's weight decay): one optimizer step, save_state, one
    more step. Returns (rank 0) every rank's {parameter: (group name, weight_decay)} per optimizer,
    the checkpoint, the weights after the further step (the uninterrupted run) and, for a split
    tied matrix, whether its two copies are still bitwise equal."""
    from titanrl.config import ModelConfig
    from titanrl.trainer.parallel.tied import tied_copies_equal
    from titanrl.trainer.trainer import GRPOTrainer

    train = dataclasses.replace(case.train, parallel=ParallelConfig(**layout))
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=case.checkpoint), train, case.temperature, seed=0))
    trainer.optimizer_step(trainer.accumulate_gradients(case.batch))
    ckpt = str(Path(workdir) / "ckpt")
    trainer.save_state(ckpt)
    trainer.optimizer_step(trainer.accumulate_gradients(case.batch))
    weights = trainer.state_dict_for_push()
    groups = []
    for part, opt in zip(trainer.pm.parts, trainer.optimizers, strict=True):
        names = {id(p): n for n, p in part.named_parameters()}
        groups.append({names[id(p)]: (g["name"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]})
    by_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, groups)
    pm = trainer.pm
    equal = tied_copies_equal(pm.parts, pm.tied_group, pm.device) if pm.split_tied else None
    if dist.get_rank() != 0:
        return {}
    return {"groups": by_rank, "checkpoint": ckpt, "weights_after": weights, "tied_copies_equal": equal}


def _rss_peak_mb() -> float:
    """This process's peak resident memory (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _reset_rss_peak() -> float:
    """Sets the peak to the current resident memory (Linux clear_refs 5); returns it, MiB."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_peak_mb()


def _old_path(checkpoint: str, dtype: torch.dtype, parallel: ParallelConfig, mesh):
    """How every rank loaded before sharded loading: the full model, then parallelize."""
    from titanrl.trainer.checkpoint import load_initial_policy

    model, _, _ = load_initial_policy(checkpoint, dtype)
    return parallelize(model, parallel, mesh)


def sharded_loading(cases: dict[str, tuple[str, Case]], layouts: dict[str, dict], dtypes: dict[str, str],
                    steps: set[str]) -> dict[str, dict[str, Any]]:
    """Per (case, layout): build_sharded_policy vs the old path (full model, then parallelize).

    For every parameter on every rank: whether its local block equals the old path's and the
    reference full tensor's slice at the block's offset (torch.equal; mismatching names by rank);
    then, for the "case/layout" keys in `steps`, the loss and the gathered gradients of one
    accumulate_gradients under each (a few seconds per key on gloo).
    cases: name -> (policy checkpoint, Case whose batch to use); dtypes: case -> storage dtype.
    """
    from titanrl.models.hf_checkpoint import checkpoint_name, from_checkpoint_tensors, read_state_dict
    from titanrl.trainer.checkpoint import is_training_checkpoint, load_policy, open_initial_policy
    from titanrl.trainer.parallel.gather import iter_full_gradients
    from titanrl.trainer.parallel.sharded_load import build_sharded_policy, local_block

    out: dict[str, dict[str, Any]] = {}
    for case_name, (ckpt, case) in cases.items():
        dtype = getattr(torch, dtypes.get(case_name, "float32"))
        if is_training_checkpoint(ckpt):
            reference = {k: v.detach() for k, v in load_policy(ckpt)[0].state_dict().items()}
        else:
            reference = from_checkpoint_tensors(read_state_dict(ckpt))  # per-expert tensors stacked
        for name, layout in layouts.items():
            parallel = ParallelConfig(**layout)
            mesh = build_mesh(parallel, "cpu")
            new = build_sharded_policy(open_initial_policy(ckpt), dtype, parallel, mesh)
            old = _old_path(ckpt, dtype, parallel, mesh)
            old_params = dict(old.named_parameters())
            unequal_old, unequal_ref, checked = [], [], 0
            for pname, param in new.named_parameters():
                block, offset = local_block(param)
                old_block, _ = local_block(old_params[pname])
                full = reference[checkpoint_name(pname, new.config)].to(dtype)
                want = full[tuple(slice(o, o + n) for o, n in zip(offset, block.shape, strict=True))]
                unequal_old += [] if torch.equal(block, old_block) else [pname]
                unequal_ref += [] if torch.equal(block, want) else [pname]
                checked += 1
            report: dict[str, Any] = {"unequal_old": unequal_old, "unequal_ref": unequal_ref, "checked": checked,
                                      "same_names": sorted(old_params) == sorted(dict(new.named_parameters()))}
            if f"{case_name}/{name}" in steps:
                for which, pm in (("new", new), ("old", old)):
                    step = GRPOStep(pm, build_optimizers(pm, case.train), case.train, case.temperature)
                    stats = step.accumulate_gradients(case.batch)
                    grads = {n: t.clone() for bucket in iter_full_gradients(pm) for n, t in bucket}
                    report[which] = {"loss": stats.loss_sum / stats.tokens, "grads": grads}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, report)
            out[f"{case_name}/{name}"] = {"ranks": gathered}
    return out if dist.get_rank() == 0 else {}


def sharded_load_memory(hf_ckpt: str, workdir: str, layout: dict) -> dict[str, float]:
    """Peak resident memory increase (MiB) of loading `hf_ckpt` on this rank: sharded from the HF
    files; sharded from a training checkpoint that this layout saved (weights only); and (rank 0
    only, as a check of the instrument) a full single-process load, which every rank used to make."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanrl.models.hf_checkpoint import load_model
    from titanrl.trainer import checkpoint as ckpt_io
    from titanrl.trainer.parallel.sharded_load import build_sharded_policy

    parallel = ParallelConfig(**layout)
    mesh = build_mesh(parallel, "cpu")
    out = {}
    base = _reset_rss_peak()
    pm = build_sharded_policy(ckpt_io.open_initial_policy(hf_ckpt), torch.float32, parallel, mesh)
    out["hf_sharded_mb"] = _rss_peak_mb() - base
    # A training checkpoint of the weights alone (its optimizer state would only cost disk time here).
    ckpt = Path(workdir) / "train_ckpt"
    ckpt_io.dcp_save({"model": get_model_state_dict(pm.parts[0])}, ckpt / ckpt_io.MODEL_OPTIM_DIR)
    if dist.get_rank() == 0:
        ckpt_io.write_hf_config(ckpt / ckpt_io.HF_CONFIG_DIR, pm.config, torch.float32, hf_ckpt)
        torch.save({"format_version": ckpt_io.FORMAT_VERSION}, ckpt / ckpt_io.TRAINER_STATE_FILE)
    dist.barrier()
    del pm
    base = _reset_rss_peak()
    pm = build_sharded_policy(ckpt_io.open_initial_policy(str(ckpt)), torch.float32, parallel, mesh)
    out["dcp_sharded_mb"] = _rss_peak_mb() - base
    del pm
    dist.barrier()
    if dist.get_rank() == 0:
        base = _reset_rss_peak()
        model, _ = load_model(hf_ckpt)
        out["full_load_mb"] = _rss_peak_mb() - base
        del model
    dist.barrier()
    return out


def expert_dispatch() -> dict[str, float]:
    """One SparseMoeBlock (8 experts, top-2) with ExpertParallelDispatch over the world against
    the same block run in one process on every rank's tokens (float64). Routing is replayed so
    that the splits are uneven, rank 1 sends no token to rank 0 and expert 1 gets none at all;
    each rank's loss weighs its outputs. Max over ranks of |difference| of the outputs, the
    inputs' gradients, the router's gradient (summed over ranks) and this rank's experts'
    gradients; and how many token copies crossed to another rank."""
    import copy
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from titanrl.models.qwen3.moe import Qwen3MoeConfig, SparseMoeBlock
    from titanrl.trainer.parallel.expert_parallel import apply_expert_parallel

    n, rank = dist.get_world_size(), dist.get_rank()
    config = Qwen3MoeConfig(hidden_size=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=6)
    gen = torch.Generator().manual_seed(0)
    ref = SparseMoeBlock(config, 0).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    block = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("ep",))
    apply_expert_parallel([block], mesh, tokens_split_over_tp=False)
    ref.experts.implementation = block.experts.implementation = "loop"  # float64: no grouped matmul
    local = config.num_experts // n
    allowed = [[0, 2, 3, 4, 5, 6, 7]] + [[e for e in range(8) if e >= local]] * (n - 1)
    xs, replays, weights = [], [], []
    for r in range(n):  # every rank draws every rank's tokens: the reference runs them all
        tokens = 5 + 4 * r
        xs.append(torch.randn(1, tokens, 8, generator=gen, dtype=torch.float64))
        pool = torch.tensor(allowed[r])
        picks = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:2]] for _ in range(tokens)])
        replays.append(picks)
        weights.append(torch.randn(1, tokens, 8, generator=gen, dtype=torch.float64))
    ref_x = [x.clone().requires_grad_() for x in xs]
    ref_y = []
    for r in range(n):
        ref.gate.replay = replays[r]
        ref_y.append(ref(ref_x[r]))
        (ref_y[-1] * weights[r]).sum().backward()
    x = xs[rank].clone().requires_grad_()
    block.gate.replay = replays[rank]
    y = block(x)
    (y * weights[rank]).sum().backward()
    router_grad = block.gate.weight.grad.clone()
    dist.all_reduce(router_grad)
    rows = slice(rank * local, (rank + 1) * local)
    diffs = {
        "output": (y - ref_y[rank]).abs().max().item(),
        "grad_input": (x.grad - ref_x[rank].grad).abs().max().item(),
        "grad_router": (router_grad - ref.gate.weight.grad).abs().max().item(),
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        mine = getattr(block.experts, name).grad.to_local()
        diffs[f"grad_{name}"] = (mine - getattr(ref.experts, name).grad[rows]).abs().max().item()
    top = torch.tensor(list(diffs.values()), dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    out = dict(zip(diffs, top.tolist(), strict=True))
    remote = torch.tensor([float((replays[rank] // local != rank).sum())])
    dist.all_reduce(remote)
    out["remote_copies"] = remote.item()
    out["expert_1_copies"] = float(sum(int((r == 1).sum()) for r in replays))
    out["rank_1_to_rank_0"] = float((replays[1] // local == 0).sum()) if n > 1 else 0.0
    return out


def set_lora_b(parts, seed: int) -> None:
    """(Any layout, every rank.) Gives every adapter's B the values randn * 0.1 drawn in module order
    from `seed` (fresh adapters have B = 0: no update and no gradient for A), each rank writing its
    block of the whole tensor."""
    from titanrl.models.common.lora import lora_modules
    from titanrl.trainer.parallel.sharded_load import local_block

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for part in parts:
            for m in lora_modules(part).values():
                full = torch.randn(m.lora_B.weight.shape, generator=gen) * 0.1
                block, offset = local_block(m.lora_B.weight)
                block.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, block.shape, strict=True))])



def _whole(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (a DTensor gathered from its shards: call on every rank)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def lora_trainer_step(case: Case, lora, layout: dict, b_seed: int, workdir: str | None = None,
                      batch_invariant: bool = False) -> dict[str, Any]:
    """GRPOTrainer with `lora` under `layout` (ParallelConfig kwargs; {} is one process): its adapters as
    built, then B set (`set_lora_b`), one accumulate_gradients + optimizer step on the case's batch.
    Returns (rank 0; {} elsewhere) whole tensors gathered from the shards: the initial adapters, the
    merged-weight push (iter_full_weights) before the step, the adapters' gradients, the adapters
    and base weights after the step, the merged-weight push and `state_dict_for_push` (by
    lora.sync) after it; the loss; and, counted over ranks, parameters other than the adapters
    that require grad, hold a .grad or sit in an optimizer, plus adapters missing from the
    optimizer or without a gradient. With `workdir`: GRPOTrainer.save after the step (its PEFT
    adapter's tensors, from rank 0), save_state, one more step,
    and a fresh trainer's load_state + that same step; how many local parameter and AdamW state
    shards differ between the two (torch.equal), over ranks. batch_invariant: the trainer's mode;
    `parity` is its (tokens different, tokens checked, max diff) against the case's logprobs."""
    from titanrl.config import ModelConfig
    from titanrl.models.common.lora import adapter_parameters
    from titanrl.trainer.parallel.gather import full_adapters
    from titanrl.trainer.parallel.mesh import all_reduce, global_rank
    from titanrl.trainer.trainer import GRPOTrainer

    def make() -> GRPOTrainer:
        train = dataclasses.replace(case.train, parallel=ParallelConfig(**layout))
        return GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=case.checkpoint), train, case.temperature, seed=0,
                                        lora=lora, batch_invariant=batch_invariant))

    def count(n: float) -> float:
        t = torch.tensor([float(n)])
        all_reduce(t, pm.mesh)
        return t.item()

    trainer = make()
    pm = trainer.pm
    out: dict[str, Any] = {"initial_adapters": {n: t.clone() for n, t in full_adapters(pm.parts).items()}}
    set_lora_b(pm.parts, b_seed)
    out["merged_before"] = {n: t.clone() for bucket in iter_full_weights(pm) for n, t in bucket}
    stats = trainer.accumulate_gradients(case.batch)
    adapters = {n: p for part in pm.parts for n, p in adapter_parameters(part).items()}
    held = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    wrong = [n for n, p in pm.named_parameters()
             if n not in adapters and (p.requires_grad or p.grad is not None or id(p) in held)]
    wrong += [n for n, p in adapters.items() if id(p) not in held or p.grad is None]
    out["wrong_parameters"] = count(len(wrong))
    out["loss"] = stats.loss_sum / stats.tokens
    out["parity"] = (stats.parity.different, stats.parity.checked, stats.parity.diff_max)
    out["grads"] = {n: _whole(p.grad) for n, p in adapters.items()}
    trainer.optimizer_step(stats)
    out["adapters"] = {n: _whole(p) for n, p in adapters.items()}
    out["base"] = {n: _whole(p) for n, p in pm.named_parameters() if n not in adapters}
    out["merged_push"] = {n: t.clone() for bucket in iter_full_weights(pm) for n, t in bucket}
    pushed = trainer.state_dict_for_push()
    out["push"] = dict(pushed.items()) if pushed is not None else None
    if workdir is not None:
        final = trainer.save(str(Path(workdir) / "final"))  # every rank gathers; rank 0 writes
        if final is not None:
            from safetensors.torch import load_file

            from titanrl.models.peft_adapter import ADAPTER_WEIGHTS, EXPORT_ADAPTER_DIR, PEFT_PREFIX

            saved = load_file(str(Path(final) / EXPORT_ADAPTER_DIR / ADAPTER_WEIGHTS))
            out["peft_export"] = {k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}
        trainer.save_state(str(Path(workdir) / "state"))
        trainer.optimizer_step(trainer.accumulate_gradients(case.batch))
        resumed = make()
        resumed.load_state(str(Path(workdir) / "state"))
        resumed.optimizer_step(resumed.accumulate_gradients(case.batch))
        mine, theirs = dict(pm.named_parameters()), dict(resumed.pm.named_parameters())
        unequal = float(mine.keys() != theirs.keys())
        unequal += sum(not torch.equal(_local(mine[n].detach()), _local(theirs[n].detach())) for n in mine)
        for opt, other in zip(trainer.optimizers, resumed.optimizers, strict=True):
            ids = {id(p): n for n, p in mine.items()}
            other_params = {id(p): n for n, p in theirs.items()}
            states = {ids[id(p)]: st for p, st in opt.state.items()}
            other_states = {other_params[id(p)]: st for p, st in other.state.items()}
            unequal += float(states.keys() != other_states.keys() or len(states) != len(adapters))
            for n, st in states.items():
                unequal += sum(not torch.equal(_local(v), _local(other_states[n][k])) for k, v in st.items())
        out["resume_unequal"] = count(unequal)
    return out if global_rank() == 0 else {}
