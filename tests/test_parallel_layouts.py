"""Every 2-process parallel layout gives the single-process GRPO step's loss and gradients (gloo, CPU).

One spawned world of 2 processes runs all checks (process start + import torch is ~10 s).
"""

import dataclasses

import pytest
import torch

from titanrl.config import LossConfig, ModelConfig, OffPolicyConfig
from titanrl.trainer.parallel.launch import run_local_world
from support.layout_check import LAYOUTS, make_case, reference
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.truncation import Truncation
from titanrl.trainer.setup import TrainerSetup

UNTIED = ["fsdp", "ddp", "tp", "tp_sp", "pp", "pp_gpipe", "pp_interleaved", "cp"]
TIED = ["fsdp", "tp", "tp_sp", "cp", "pp", "pp_interleaved"]
TOL = 1e-5


INVARIANT_DP = {"fsdp": dict(dp_shard=2), "ddp": dict(dp_replicate=2)}
INVARIANT_PP = {"pp": dict(pp=2, pp_schedule="1F1B"), "pp_gpipe": dict(pp=2, pp_schedule="GPipe"),
                "pp_interleaved": dict(pp=2, pp_schedule="Interleaved1F1B")}
INVARIANT = {**INVARIANT_DP, **INVARIANT_PP}
"""Layouts run with batch_invariant=True (on the tied policy: pp splits the tied matrix)."""

TRUNCATED = ["fsdp", "pp", "cp"]
"""Layouts checked with the trainer scoring under top-k 20 + top-p 0.9 at T=0.7 (tp is refused)."""

FORWARD_PARITY = ["fsdp", "ddp", "tp_sp", "cp", "pp", "pp_gpipe", "pp_interleaved"]
"""Layouts whose forward-only parity (GRPOStep.measure_parity) is checked, tied policy."""

LOSS_VARIANT = dict(
    loss=LossConfig(objective="gspo", gspo_clip_eps=(0.02, 0.03), entropy_coef=0.01),
    off_policy=OffPolicyConfig(correction="tis_sequence", cap=1.1),
)
"""A loss with every sequence-level part (GSPO's ratio, seq-mean-token-mean weights, a sequence
correction) and the entropy bonus: checked under dp_shard and under cp, which splits each row."""
LOSS_VARIANT_LAYOUTS = ["fsdp", "cp"]

FAMILIES = ["llama", "qwen2"]
FAMILY_LAYOUTS = ["tp_sp", "pp"]
"""Other dense families (untied; Llama with biases on every projection, Qwen2 with q/k/v biases)
checked under tp_sp (column-parallel biases sharded, row-parallel ones replicated) and pp (1F1B)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Results of one 2-rank world: layout reports on an untied and a tied policy, ring attention
    diffs, batch-invariant parity and loss under data parallelism and pipelines (and the
    single-process trainer's)."""
    tmp = tmp_path_factory.mktemp("parallel_layouts")
    untied, tied = make_case(tmp, tied=False), make_case(tmp, tied=True)
    truncated = dataclasses.replace(untied, temperature=0.7, truncation=Truncation(top_k=20, top_p=0.9))
    truncated_ref = reference(truncated)
    from parallel_worlds import run_jobs, with_invariant_logprobs

    invariant = with_invariant_logprobs(tied)
    variant = dataclasses.replace(untied, train=dataclasses.replace(untied.train, **LOSS_VARIANT))
    family_cases = {family: make_case(tmp, family=family) for family in FAMILIES}
    family_refs = {family: reference(case) for family, case in family_cases.items()}
    single = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=invariant.checkpoint),
            invariant.train,
            invariant.temperature,
            seed=0,
            batch_invariant=True,
        )
    ).accumulate_gradients(invariant.batch)
    jobs = [
        ("layouts", (UNTIED, untied, reference(untied))),
        ("layouts", (TIED, tied, reference(tied))),
        ("ring_attention", ()),
        ("batch_invariant", (invariant, INVARIANT)),
        ("forward_parity", (tied, {name: LAYOUTS[name] for name in FORWARD_PARITY})),
        ("vocab_parallel_logprobs", ()),
        ("vocab_shards", ([untied, tied], LAYOUTS["tp"])),
        ("layouts", (TRUNCATED, truncated, truncated_ref)),
        ("layouts", (LOSS_VARIANT_LAYOUTS, variant, reference(variant))),
        *(("layouts", (FAMILY_LAYOUTS, family_cases[f], family_refs[f])) for f in FAMILIES),
    ]
    results = run_local_world(run_jobs, 2, jobs, timeout_s=600)[0]
    return {"untied": results[0], "tied": results[1], "ring": results[2], "invariant": results[3],
            "forward_parity": results[4], "vocab_parallel": results[5], "vocab_shards": results[6],
            "truncated": results[7], "truncated_reference": truncated_ref,
            "loss_variant": results[8],
            "families": {f: results[9 + i] for i, f in enumerate(FAMILIES)},
            "family_params": {f: sorted(family_refs[f].grads) for f in FAMILIES},
            "invariant_single": single.parity, "invariant_single_loss": single.loss_sum / single.tokens}


def _assert_matches(report: dict) -> None:
    assert report["loss_rel_diff"] <= TOL, report
    assert report["grad_rel_diff"] <= TOL, report
    assert report["grad_max_param_rel_diff"] <= TOL, report
    assert report["grad_norm_rel_diff"] <= TOL, report
    assert report["entropy_sum_rel_diff"] <= TOL, report  # train/entropy: each token counted once
    assert report["clipped_tokens_equal"], report
    # AdamW's first step is ~lr * sign(g): elements with |g| near zero amplify 1e-7 gradient
    # noise (up to ~1e-3 seen), so the update agrees less tightly; a wrong shard update is O(1) off.
    assert report["update_rel_diff"] <= 1e-2, report


@pytest.mark.parametrize("layout", UNTIED)
def test_layout_equals_single_process(world, layout):
    """Loss, full gathered gradient (global and per parameter), grad norm and the clipped AdamW
    update under `layout` equal GRPOTrainer's on the same batch (untied embeddings)."""
    _assert_matches(world["untied"][layout])


@pytest.mark.parametrize("layout", TIED)
def test_layout_equals_single_process_tied(world, layout):
    """Same with tied embedding / LM head (one shared, sharded or replicated parameter; under
    pp=2, 1F1B and interleaved, a first-stage and a last-stage copy whose gradients are summed):
    the gathered tied gradient is the full one and the grad norm counts it once. Under pp, after
    two optimizer steps the two copies are bitwise equal (torch.equal)."""
    report = world["tied"][layout]
    _assert_matches(report)
    assert report["tied_copies_equal"] is (True if layout.startswith("pp") else None), report


def test_ring_attention_matches_causal_attention(world):
    """Ring attention over 2 ranks, load-balanced and contiguous chunks, GQA: output and the
    gradients of q, k and v equal causal SDPA on the whole sequence to 1e-5."""
    ring = world["ring"]
    assert set(ring) == {f"{c}_{w}" for c in ("balanced", "contiguous") for w in ("out", "dq", "dk", "dv")}
    for key, diff in ring.items():
        assert diff <= TOL, (key, diff)


@pytest.mark.parametrize("layout", sorted(INVARIANT_DP))
def test_batch_invariant_logprobs_bitwise_under_data_parallel(world, layout):
    """With batch_invariant=True, every trained token's logprob under `layout` (rows split over
    2 ranks, other micro-batches and padding) has exactly the bits the single-process model gives
    on the whole batch: the step's parity count of differing tokens is 0, as it is for
    GRPOTrainer(batch_invariant=True) in one process."""
    single = world["invariant_single"]
    assert single.checked > 0 and single.different == 0, single
    got = world["invariant"][layout]
    assert got["checked"] == single.checked and got["different"] == 0 and got["diff_max"] == 0.0, got


@pytest.mark.parametrize("layout", sorted(INVARIANT_PP))
def test_batch_invariant_logprobs_and_loss_bitwise_under_pipeline(world, layout):
    """With batch_invariant=True under pp=2 (1F1B, GPipe, interleaved: 2 stages per rank, tied
    matrix split over first and last stage), every trained token's logprob computed by the last
    stage has exactly the single-process bits: parity differs on 0 of the same tokens GRPOTrainer
    checks, so the stages ran the batch-invariant kernels (layers, rotary table, LM head) and
    `kernels.token_logprobs`. The loss is bitwise equal to GRPOTrainer(batch_invariant=True)'s
    too: its 6 micro-batches of 3 rows hold the same rows as the single-process ones (16 rows,
    micro_batch_size 3; the last one padded with zero-mask rows) and each is trimmed alike, so
    every micro-batch's loss sum has the same bits."""
    single = world["invariant_single"]
    got = world["invariant"][layout]
    assert single.checked > 0 and got["checked"] == single.checked, (got, single)
    assert got["different"] == 0 and got["diff_max"] == 0.0, got
    assert torch.equal(torch.tensor(got["loss"], dtype=torch.float64),
                       torch.tensor(world["invariant_single_loss"], dtype=torch.float64)), got


@pytest.mark.parametrize("layout", FORWARD_PARITY)
def test_forward_only_parity_equals_gradient_pass(world, layout):
    """GRPOStep.measure_parity under `layout` (forward only; pipelines via the schedule's
    eval) gives exactly the parity the gradient pass reports at the same weights: diff sum, diff
    max, tokens different and tokens checked are equal floats (noisy generator logprobs, so the
    diffs are far from 0). Afterwards every parameter's .grad is still None and every optimizer
    state empty, on every rank."""
    r = world["forward_parity"][layout]
    forward = torch.tensor(r["forward"], dtype=torch.float64)
    grad_pass = torch.tensor(r["grad_pass"], dtype=torch.float64)
    assert torch.equal(forward, grad_pass), r
    assert grad_pass[1] > 0.1 and grad_pass[3] > 0, r  # a real comparison: tokens checked, diffs seen
    assert r["no_grads_or_state"] is True, r


def test_vocab_parallel_logprobs_equal_single_process(world):
    """The chunked logprob Function over 2 vocabulary shards (259 rows: uneven, 130 + 129; a
    Shard(0) DTensor head and an explicit shard + group + start), targets at both ends of both
    shards, losses on logprobs and entropy: logprobs, entropies, the hidden states' gradient and
    each rank's rows of the head gradient equal the single-process Function's to 1e-12 (float64),
    and no rank computed logits wider than its 130-row shard."""
    r = world["vocab_parallel"]
    assert r.pop("max_logits_width") == 130.0, r
    for key, diff in r.items():
        assert diff <= 1e-12, (key, diff)


def test_tp_shards_embedding_and_head_over_the_vocabulary(world):
    """Under tp=2 each rank holds 130 or 129 of the 259 vocabulary rows of the embedding and of the
    LM head (never the whole matrix); with tied embeddings the head is the embedding's one sharded
    parameter. (Loss and gradients under tp / tp_sp, tied and untied: the layout tests above.)"""
    for report in world["vocab_shards"]:
        assert report["vocab"] == 259, report
        assert [r[:2] for r in report["rows"]] == [[130, 130], [129, 129]], report
        assert all(r[2] == float(report["tied"]) for r in report["rows"]), report


@pytest.mark.parametrize("layout", TRUNCATED)
def test_truncated_logprobs_under_layout_equal_single_process(world, layout):
    """Scoring under top-k 20 + top-p 0.9 at T=0.7 (the random completions are mostly outside the
    kept set: scored over kept + {target}): loss, gradients, grad norm, update and the count of
    targets outside the kept set under fsdp, pp (1F1B) and cp equal the single-process trainer's."""
    report = world["truncated"][layout]
    _assert_matches(report)
    assert report["truncation_outside_equal"], report
    assert world["truncated_reference"].stats["truncation_outside_tokens"] > 0
@pytest.mark.parametrize("layout", LOSS_VARIANT_LAYOUTS)
def test_loss_variant_equals_single_process(world, layout):
    """train.loss.objective='gspo' with a sequence-level off-policy correction and an entropy bonus: loss,
    gradient, norm, update and clip count under `layout` (fsdp: rows over 2 ranks; cp: each row's
    tokens over 2 ranks, the sequence sums all-reduced) equal GRPOTrainer's in one process."""
    _assert_matches(world["loss_variant"][layout])


@pytest.mark.parametrize("layout", FAMILY_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_layout_equals_single_process(world, family, layout):
    """The Llama (biases on q/k/v/o and gate/up/down) and Qwen2 (q/k/v biases) policies, neither
    with q/k norms, under tp_sp and pp: loss, gradients (biases' included), norm, update and clip
    count equal GRPOTrainer's in one process."""
    names = world["family_params"][family]
    biases = {n.split("layers.0.", 1)[1] for n in names if "layers.0." in n and n.endswith(".bias")}
    want = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    if family == "llama":
        want |= {"self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"}
    assert biases == want and not any("q_norm" in n for n in names), names
    report = world["families"][family][layout]
    assert report["family"] == family, report
    _assert_matches(report)
