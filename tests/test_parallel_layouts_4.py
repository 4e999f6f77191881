"""4-process layouts (HSDP, 2-D and pipeline combinations, cp=4) against the single-process step,
and batch-invariant logprobs under pipeline x FSDP.

Slow: 4 processes on 2 shared cores; one world runs all of them.
"""

import pytest

from titanrl.config import ModelConfig
from titanrl.trainer.parallel.launch import run_local_world
from titanrl.trainer.parallel.layout_check import make_case, reference
from titanrl.trainer.trainer import GRPOTrainer

LAYOUTS = ["hsdp", "fsdp+tp", "fsdp+tp_sp", "fsdp+cp", "cp+tp_sp", "pp+fsdp", "pp+tp", "pp+cp", "cp4"]


INVARIANT = {"pp+fsdp": dict(pp=2, dp_shard=2)}
"""4-rank layouts run with batch_invariant=True (tied policy)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One 4-rank world: reports of every 4-rank layout on one untied tiny policy and batch, and
    batch-invariant parity / loss under INVARIANT (with GRPOTrainer(batch_invariant=True)'s)."""
    tmp = tmp_path_factory.mktemp("parallel_layouts_4")
    from parallel_worlds import run_jobs, with_invariant_logprobs

    case = make_case(tmp)
    invariant = with_invariant_logprobs(make_case(tmp, tied=True))
    single = GRPOTrainer(ModelConfig(checkpoint=invariant.checkpoint), invariant.train, invariant.temperature,
                         seed=0, batch_invariant=True).accumulate_gradients(invariant.batch)
    jobs = [("layouts", (LAYOUTS, case, reference(case))), ("batch_invariant", (invariant, INVARIANT))]
    results = run_local_world(run_jobs, 4, jobs, timeout_s=900)[0]
    return {"reports": results[0], "invariant": results[1], "single": single}


@pytest.fixture(scope="module")
def reports(world):
    """Reports of every 4-rank layout."""
    return world["reports"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_4_rank_layout_equals_single_process(reports, layout):
    """Loss, full gradient (global and per parameter) and grad norm equal GRPOTrainer's to 1e-5."""
    r = reports[layout]
    for key in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff", "grad_norm_rel_diff"):
        assert r[key] <= 1e-5, (key, r)
    assert r["clipped_tokens_equal"] and r["update_rel_diff"] <= 1e-2, r


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
