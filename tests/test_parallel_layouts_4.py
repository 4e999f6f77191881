"""4-process layouts (HSDP, 2-D and pipeline combinations, cp=4) against the single-process step.

Slow: 4 processes on 2 shared cores; one world runs all of them.
"""

import pytest

from titanrl.trainer.parallel.launch import run_local_world
from titanrl.trainer.parallel.layout_check import make_case, reference

LAYOUTS = ["hsdp", "fsdp+tp", "fsdp+tp_sp", "fsdp+cp", "cp+tp_sp", "pp+fsdp", "pp+tp", "pp+cp", "cp4"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Reports of every 4-rank layout on one untied tiny policy and batch."""
    case = make_case(tmp_path_factory.mktemp("parallel_layouts_4"))
    from parallel_worlds import run_jobs

    return run_local_world(run_jobs, 4, [("layouts", (LAYOUTS, case, reference(case)))], timeout_s=900)[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_4_rank_layout_equals_single_process(reports, layout):
    """Loss, full gradient (global and per parameter) and grad norm equal GRPOTrainer's to 1e-5."""
    r = reports[layout]
    for key in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff", "grad_norm_rel_diff"):
        assert r[key] <= 1e-5, (key, r)
    assert r["clipped_tokens_equal"] and r["update_rel_diff"] <= 1e-2, r
