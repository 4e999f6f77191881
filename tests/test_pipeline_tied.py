"""Pipeline parallel combined with FSDP and with TP on a tied-embedding policy, against the
single-process GRPO step (4 gloo processes, one world; the 2-process tied pipeline layouts run
in test_parallel_layouts.py, tied pipeline checkpoints in test_parallel_checkpoint.py).
"""

import pytest

from titanrl.trainer.parallel.launch import run_local_world
from support.layout_check import make_case, reference

LAYOUTS = ["pp+fsdp", "pp+tp"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Reports of pp=2 x dp_shard=2 and pp=2 x tp=2 on one tied tiny policy and batch."""
    case = make_case(tmp_path_factory.mktemp("pipeline_tied"), tied=True)
    from parallel_worlds import run_jobs

    return run_local_world(run_jobs, 4, [("layouts", (LAYOUTS, case, reference(case)))], timeout_s=600)[0][0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_pipeline_layout_equals_single_process(reports, layout):
    """The tied matrix's copies on the first and last stage (FSDP-sharded DTensors under pp+fsdp,
    replicated plain tensors under pp+tp) get the full tied gradient: loss, the full gathered
    gradient (global and per parameter, the tied one included) and the grad norm (tied matrix
    counted once) equal GRPOTrainer's to 1e-5; after two optimizer steps the copies are bitwise
    equal on every (dp, tp) coordinate."""
    r = reports[layout]
    assert r["tied_embeddings"] and r["tied_copies_equal"] is True, r
    for key in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff", "grad_norm_rel_diff",
                "entropy_sum_rel_diff"):
        assert r[key] <= 1e-5, (key, r)
    assert r["clipped_tokens_equal"] and r["update_rel_diff"] <= 1e-2, r
