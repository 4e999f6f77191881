"""4-process layouts (HSDP, 2-D and pipeline combinations, cp=4, tied pp=4) against the
single-process step, batch-invariant logprobs under pipeline x FSDP, and forward-only parity.

Slow: 4 processes on 2 shared cores; one world runs all of them.
"""

import pytest
import torch

from titanrl.config import ModelConfig
from titanrl.trainer.parallel.launch import run_local_world
from support.layout_check import LAYOUTS as LAYOUTS_BY_NAME, make_case, reference
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup

LAYOUTS = ["hsdp", "fsdp+tp", "fsdp+tp_sp", "fsdp+cp", "cp+tp_sp", "pp+fsdp", "pp+tp", "pp+cp", "cp4"]


TIED = ["pp4"]
"""4-rank layouts run on the tied policy (pp=4: the tied matrix's copies on pp ranks 0 and 3 only)."""

FORWARD_PARITY = ["pp+fsdp", "pp4"]
"""4-rank pipelines whose forward-only parity (schedule eval; FSDP stages) is checked, tied policy."""

INVARIANT = {"pp+fsdp": dict(pp=2, dp_shard=2)}
"""4-rank layouts run with batch_invariant=True (tied policy)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One 4-rank world: reports of every 4-rank layout on one untied tiny policy and batch,
    batch-invariant parity / loss under INVARIANT (with GRPOTrainer(batch_invariant=True)'s),
    reports and tied groups of TIED on the tied policy, and forward-only vs gradient-pass parity."""
    tmp = tmp_path_factory.mktemp("parallel_layouts_4")
    from parallel_worlds import run_jobs, with_invariant_logprobs

    case, tied = make_case(tmp), make_case(tmp, tied=True)
    invariant = with_invariant_logprobs(tied)
    single = GRPOTrainer(
        TrainerSetup(
            ModelConfig(checkpoint=invariant.checkpoint),
            invariant.train,
            invariant.temperature,
            seed=0,
            batch_invariant=True,
        )
    ).accumulate_gradients(invariant.batch)
    jobs = [("layouts", (LAYOUTS, case, reference(case))), ("batch_invariant", (invariant, INVARIANT)),
            ("layouts", (TIED, tied, reference(tied))), ("tied_group_ranks", (tied, LAYOUTS_BY_NAME["pp4"])),
            ("forward_parity", (tied, {name: LAYOUTS_BY_NAME[name] for name in FORWARD_PARITY}))]
    results = run_local_world(run_jobs, 4, jobs, timeout_s=900)[0]
    return {"reports": results[0], "invariant": results[1], "single": single, "tied": results[2],
            "tied_groups": results[3], "forward_parity": results[4]}


@pytest.fixture(scope="module")
def reports(world):
    """Reports of every 4-rank layout."""
    return world["reports"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_4_rank_layout_equals_single_process(reports, layout):
    """Loss, full gradient (global and per parameter) and grad norm equal GRPOTrainer's to 1e-5."""
    r = reports[layout]
    for key in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff", "grad_norm_rel_diff",
                "entropy_sum_rel_diff"):
        assert r[key] <= 1e-5, (key, r)
    assert r["clipped_tokens_equal"] and r["update_rel_diff"] <= 1e-2, r


@pytest.mark.slow
@pytest.mark.parametrize("layout", TIED)
def test_4_rank_tied_layout_equals_single_process(world, layout):
    """Tied embedding / LM head under pp=4 (1F1B, one layer per stage): only pp ranks 0 and 3 hold
    a copy of the tied matrix (ranks 1 and 2 are in no tied group), yet loss, full gradient (global
    and per parameter, the tied one summed over both copies) and grad norm (counting it once) equal
    GRPOTrainer's to 1e-5, and after two optimizer steps the two copies are bitwise equal."""
    r = world["tied"][layout]
    assert r["tied_embeddings"] is True, r
    for key in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff", "grad_norm_rel_diff",
                "entropy_sum_rel_diff"):
        assert r[key] <= 1e-5, (key, r)
    assert r["clipped_tokens_equal"] and r["update_rel_diff"] <= 1e-2, r
    assert r["tied_copies_equal"] is True, r
    assert world["tied_groups"] == [[0, 3], None, None, [0, 3]], world["tied_groups"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", FORWARD_PARITY)
def test_4_rank_forward_only_parity_equals_gradient_pass(world, layout):
    """GRPOStep.measure_parity under FSDP-sharded pipeline stages (pp=2 x dp_shard=2) and
    pp=4 runs the schedule's forward-only eval and gives exactly the gradient pass's parity
    (equal floats), leaving every .grad None and every optimizer state empty on every rank."""
    r = world["forward_parity"][layout]
    forward = torch.tensor(r["forward"], dtype=torch.float64)
    grad_pass = torch.tensor(r["grad_pass"], dtype=torch.float64)
    assert torch.equal(forward, grad_pass), r
    assert grad_pass[1] > 0.1 and grad_pass[3] > 0, r
    assert r["no_grads_or_state"] is True, r


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(INVARIANT))
def test_4_rank_batch_invariant_logprobs_bitwise(world, layout):
    """With batch_invariant=True under pp=2 x dp_shard=2 (FSDP-sharded pipeline stages, tied matrix
    split over the stages, 8 rows per dp rank in micro-batches of 2), every trained token's logprob
    has exactly the single-process bits: parity differs on 0 of the same tokens GRPOTrainer checks.
    The loss is a float32 sum whose grouping follows the micro-batches (2 rows here, 3 in one
    process) and the dp ranks, so it is only equal to rounding (rel 1e-6), not bitwise."""
    single, got = world["single"], world["invariant"][layout]
    assert single.parity.checked > 0 and got["checked"] == single.parity.checked, (got, single.parity)
    assert got["different"] == 0 and got["diff_max"] == 0.0, got
    want = single.loss_sum / single.tokens
    assert abs(got["loss"] - want) <= 1e-6 * abs(want), (got, want)
