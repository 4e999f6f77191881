"""LoRA under FSDP2 / HSDP and tensor parallel (2 gloo processes) gives the single-process trainer's
adapters, gradients, step and pushes; the base stays frozen and bitwise unchanged; resume is exact.

One GRPOTrainer per layout runs `parallel_worlds.lora_trainer_step` in the session's shared 2-rank
world (conftest's `gloo_world`), the same function in this process is the reference. B is set
non-zero first (fresh adapters have B = 0, which gives A no gradient). The case's lr is 1e-4:
AdamW's first step is about lr * sign(g), so an element whose gradient is ~1e-8 (float noise
flips its sign) can move by up to 2 lr either way; at 1e-4 that stays under the 1e-5 tolerance, and a
wrong or missing gradient reduction, or a step on the wrong shard, is O(lr) off.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from support.layout_check import make_case
from titanrl.config import LoraConfig, ModelConfig
from titanrl.trainer.checkpoint import load_initial_policy
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer

TOL = 1e-5
B_SEED = 1
ADAPTER = LoraConfig(rank=4, alpha=8.0)  # lora.sync='adapter': the unmerged form, adapter-only pushes
MERGED = LoraConfig(rank=4, alpha=8.0, sync="merged")  # the merged form (re-merged in the backward), merged pushes

RUNS: dict[str, tuple[str, LoraConfig, dict, bool]] = {
    # name: (case, lora, layout, resume check)
    "fsdp": ("qwen3", ADAPTER, dict(dp_shard=2), True),
    "hsdp": ("qwen3", ADAPTER, dict(dp_replicate=2), False),  # HSDP's replicate dimension (dp_shard 1)
    "tp": ("qwen3", ADAPTER, dict(tp=2), True),
    "tp_sp": ("qwen3", ADAPTER, dict(tp=2, sequence_parallel=True), False),
    "fsdp_merged": ("qwen3", MERGED, dict(dp_shard=2), False),
    "tp_merged": ("qwen3", MERGED, dict(tp=2), False),
    "llama_tp": ("llama", ADAPTER, dict(tp=2), False),  # biases on every projection: column-split and replicated
    "fsdp_from_trained": ("trained", ADAPTER, dict(dp_shard=2), False),
}
"""Qwen3 has per-head q/k norms (TP replicates them with a style that would unfreeze them), Llama
biases on q/k/v/o and gate/up/down; 'trained' is the Qwen3 case starting from a full fine-tuning
run's training checkpoint (save_state after a step) instead of the HF directory."""


INVARIANT = {"fsdp_merged": (MERGED, dict(dp_shard=2)), "fsdp_adapter": (ADAPTER, dict(dp_shard=2)),
             "hsdp_merged": (MERGED, dict(dp_replicate=2))}
"""Runs with batch_invariant=True, on the Qwen3 case whose generator logprobs are the single-process
batch-invariant LoRA policy's (both forms; B set)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory, gloo_world):
    tmp = tmp_path_factory.mktemp("lora_parallel")
    cases = {}
    for family in ("qwen3", "llama"):
        case = make_case(tmp, family=family)
        optimizer = dataclasses.replace(case.train.optimizer, lr=1e-4)
        cases[family] = dataclasses.replace(case, train=dataclasses.replace(case.train, optimizer=optimizer))
    full = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=cases["qwen3"].checkpoint), cases["qwen3"].train,
                                    cases["qwen3"].temperature, seed=0))
    full.optimizer_step(full.accumulate_gradients(cases["qwen3"].batch))
    full.save_state(str(tmp / "trained"))
    cases["trained"] = dataclasses.replace(cases["qwen3"], checkpoint=str(tmp / "trained"))
    from parallel_worlds import lora_trainer_step, run_jobs, with_lora_logprobs

    refs = {(family, lora.sync): lora_trainer_step(cases[family], lora, {}, B_SEED)
            for family, lora, _, _ in RUNS.values()}
    jobs = [("lora_trainer_step", (cases[family], lora, layout, B_SEED, str(tmp / name) if resume else None))
            for name, (family, lora, layout, resume) in RUNS.items()]
    invariant_cases = {sync: with_lora_logprobs(cases["qwen3"], lora, B_SEED) for sync, lora in
                       (("merged", MERGED), ("adapter", ADAPTER))}
    invariant_refs = {sync: lora_trainer_step(case, lora, {}, B_SEED, batch_invariant=True)["parity"]
                      for (sync, case), lora in zip(invariant_cases.items(), (MERGED, ADAPTER), strict=True)}
    jobs += [("lora_trainer_step", (invariant_cases[lora.sync], lora, layout, B_SEED, None, True))
             for lora, layout in INVARIANT.values()]
    results = gloo_world.run(run_jobs, jobs, timeout_s=600)[0]
    world = {"invariant": {name: (results[len(RUNS) + i]["parity"], invariant_refs[lora.sync])
                           for i, (name, (lora, _)) in enumerate(INVARIANT.items())}}
    checkpoint = {family: {n: p.detach() for n, p in load_initial_policy(case.checkpoint, torch.float32)[0]
                           .named_parameters()} for family, case in cases.items()}
    world.update({name: {"got": results[i], "ref": refs[(family, lora.sync)], "checkpoint": checkpoint[family]}
                  for i, (name, (family, lora, _, _)) in enumerate(RUNS.items())})
    return world


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[n].double() - want[n].double()).abs().max().item() for n in want)


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (all of them if the names differ)."""
    if got.keys() != want.keys():
        return sorted(set(got) | set(want))
    return [n for n in want if not torch.equal(got[n], want[n])]


@pytest.mark.parametrize("run", list(RUNS))
def test_adapters_start_as_in_one_process(world, run):
    """The adapters built on the meta device and sharded (A Kaiming-uniform from the run's seed, B zeros)
    are bitwise the single-process trainer's; with B then set, the merged-weight push gathered from
    the shards (W, A and B whole, then merged) is bitwise the single-process one."""
    got, ref = world[run]["got"], world[run]["ref"]
    initial = ref["initial_adapters"]
    assert len(initial) == 2 * 7 * 4 and not _equal(got["initial_adapters"], initial)
    assert all(t.abs().max() > 0 for n, t in initial.items() if n.endswith("lora_A.weight"))
    assert all(t.abs().max() == 0 for n, t in initial.items() if n.endswith("lora_B.weight"))
    assert not _equal(got["merged_before"], ref["merged_before"])


@pytest.mark.parametrize("run", list(RUNS))
def test_adapter_gradients_and_step_equal_one_process(world, run):
    """After one accumulate_gradients + optimizer step: every A's and B's gradient (gathered whole)
    equals the single-process one within 1e-5, and every gradient is non-zero; the loss agrees to
    1e-6 relative; the adapters after the step equal the single-process ones within 1e-5, and
    moved by far more than that."""
    got, ref = world[run]["got"], world[run]["ref"]
    assert all(g.abs().max() > 1e-3 for g in ref["grads"].values())
    assert _max_diff(got["grads"], ref["grads"]) <= TOL
    assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    assert _max_diff(got["adapters"], ref["adapters"]) <= TOL
    before = dict(ref["initial_adapters"])
    assert min(_max_diff({n: ref["adapters"][n]}, {n: before[n]}) for n in before if "lora_A" in n) > 5 * TOL


@pytest.mark.parametrize("run", list(RUNS))
def test_base_stays_frozen(world, run):
    """On every rank no parameter but the adapters requires grad, gets a gradient or sits in the
    optimizer (tensor parallel's replicated q/k norms included), every adapter does; after the step
    every base tensor is bitwise the checkpoint's."""
    got = world[run]["got"]
    assert got["wrong_parameters"] == 0
    assert not _equal(got["base"], world[run]["checkpoint"])


@pytest.mark.parametrize("run", list(RUNS))
def test_pushes_gather_whole_tensors(world, run):
    """After the step, the merged-weight push (iter_full_weights: every base name, the adapted ones
    merged) equals the single-process one within 1e-5; `state_dict_for_push` on rank 0 holds what
    lora.sync says: the adapter factors alone, bitwise the gathered adapters ('adapter'), or the
    merged weights, bitwise that push ('merged')."""
    got, ref = world[run]["got"], world[run]["ref"]
    assert _max_diff(got["merged_push"], ref["merged_push"]) <= TOL
    assert got["merged_push"].keys() == world[run]["checkpoint"].keys()  # untied: the head too
    want = got["adapters"] if RUNS[run][1].sync == "adapter" else got["merged_push"]
    assert not _equal(got["push"], want)


@pytest.mark.parametrize("run", [name for name, spec in RUNS.items() if spec[3]])
def test_resume_is_exact_and_export_writes_whole_adapters(world, run):
    """save_state after the step, one more step; a fresh trainer under the same layout that
    load_state()s and takes the same step ends with every local parameter shard (frozen base
    and adapters) and every AdamW state shard bitwise equal, on every rank. GRPOTrainer.save's
    PEFT adapter (final/adapter/) holds every factor whole, bitwise the gathered adapters."""
    got = world[run]["got"]
    assert got["resume_unequal"] == 0
    assert not _equal(got["peft_export"], got["adapters"])


@pytest.mark.parametrize("run", list(INVARIANT))
def test_batch_invariant_logprobs_bitwise_under_data_parallel(world, run):
    """batch_invariant=True with adapters (B non-zero) under FSDP2 / HSDP, merged and unmerged form:
    every trained token's logprob has exactly the bits the single-process LoRA policy gives on the
    whole batch (parity: 0 of the same tokens differ, max diff 0.0), as in one process."""
    (different, checked, diff_max), (ref_different, ref_checked, _) = world["invariant"][run]
    assert ref_checked > 0 and ref_different == 0
    assert checked == ref_checked and different == 0 and diff_max == 0.0
