"""A tiny mixture-of-experts policy under every kind of layout, expert parallelism included: loss and
gradients equal the single-process GRPO step's; the all-to-all dispatch against one process;
checkpoints reshard between ep layouts; sharded loading and weight publishing of expert weights.

One 2-process gloo world runs the 2-rank checks; the 4-rank layouts (slow) run in another.
"""

import pytest
import torch

from titanrl.models.hf_checkpoint import load_model
from titanrl.trainer.checkpoint import export_hf
from titanrl.trainer.parallel.launch import run_local_world
from support.layout_check import LAYOUTS, make_case, reference

EXPERT_PARALLEL = ["ep", "tp_sp+ep"]
"""2-rank layouts with expert parallelism: experts over dp_shard ranks, and over the tp ranks."""
EP1 = ["fsdp", "ddp", "tp", "tp_sp", "pp", "cp"]
"""2-rank layouts without it (the sparse block replicated over tp under tp / tp_sp)."""
LAYOUTS_4 = ["fsdp+ep", "ep4", "hsdp+ep", "fsdp+tp_sp+ep"]
"""4-rank expert-parallel layouts: efsdp x ep, ep over all of dp_shard, HSDP, FSDP with ep == tp."""
TOL = 1e-5
BUCKET_BYTES = 40_000


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return make_case(tmp_path_factory.mktemp("moe_case"), moe=True)


@pytest.fixture(scope="module")
def world(case, tmp_path_factory):
    """One 2-rank world: layout reports, the dispatch check, resharding between ep and ep=1
    layouts (both ways), publishing and sharded loading under ep."""
    from parallel_worlds import run_jobs

    tmp = tmp_path_factory.mktemp("moe_world")
    ep = {name: LAYOUTS[name] for name in EXPERT_PARALLEL}
    jobs = [
        ("layouts", (EXPERT_PARALLEL + EP1, case, reference(case))),
        ("expert_dispatch", ()),
        ("resharding", (case, str(tmp / "from_ep"), LAYOUTS["ep"], {"fsdp": LAYOUTS["fsdp"], "tp_sp+ep": LAYOUTS["tp_sp+ep"]}, None)),
        ("resharding", (case, str(tmp / "from_tp_ep"), LAYOUTS["tp_sp+ep"], {"ep": LAYOUTS["ep"]}, None)),
        ("publish", (case, ep, BUCKET_BYTES)),
        ("sharded_loading", ({"moe": (case.checkpoint, case)}, ep, {}, {"moe/ep", "moe/tp_sp+ep"})),
    ]
    results = run_local_world(run_jobs, 2, jobs, timeout_s=900)[0]
    return {"reports": results[0], "dispatch": results[1], "from_ep": results[2], "from_tp_ep": results[3],
            "publish": results[4], "sharded": results[5]}


def _assert_matches(report: dict) -> None:
    assert report["moe"] is True, report
    for key in ("loss_rel_diff", "grad_rel_diff", "grad_max_param_rel_diff", "grad_norm_rel_diff",
                "entropy_sum_rel_diff"):
        assert report[key] <= TOL, (key, report)
    assert report["clipped_tokens_equal"] and report["update_rel_diff"] <= 1e-2, report


@pytest.mark.parametrize("layout", EXPERT_PARALLEL + EP1)
def test_moe_layout_equals_single_process(world, layout):
    """Loss, full gathered gradient (global and per parameter: stacked experts, routers), grad norm
    and the clipped AdamW update of the tiny MoE (3 sparse layers, 4 experts, top-2) under `layout`
    equal GRPOTrainer's on the same batch to 1e-5."""
    _assert_matches(world["reports"][layout])


def test_expert_dispatch_equals_local_experts(world):
    """ExpertParallelDispatch over 2 ranks (uneven splits, rank 1 sends rank 0 nothing, expert 1
    gets no token): outputs, input gradients, the router gradient and each rank's expert
    gradients equal the single-process block's (float64) to 1e-12; tokens did cross ranks."""
    r = dict(world["dispatch"])
    assert r.pop("remote_copies") > 0 and r.pop("expert_1_copies") == 0 and r.pop("rank_1_to_rank_0") == 0, r
    for key, diff in r.items():
        assert diff <= 1e-12, (key, diff)


@pytest.mark.parametrize("source, loads", [("from_ep", ["fsdp", "tp_sp+ep"]), ("from_tp_ep", ["ep"])])
def test_checkpoint_reshards_between_expert_layouts(world, source, loads):
    """Saved after a step under ep=2 over dp_shard (from_ep) or over tp (from_tp_ep), loaded under
    ep=1 FSDP and the other ep layout: gathered weights bitwise the saved ones, loss at load and
    after one more step (AdamW moments loaded) equal to continuing the saving run."""
    res = world[source]
    saved = res["saved"]
    assert any(".mlp.experts." in n for n in saved["weights"])
    for name in loads:
        got = res[name]
        assert sorted(got["weights"]) == sorted(saved["weights"])
        for n, w in saved["weights"].items():
            assert torch.equal(got["weights"][n], w), (name, n)
        assert abs(got["loss"] - saved["loss"]) <= 1e-5 * abs(saved["loss"]), name
        assert abs(got["loss_after_step"] - saved["loss_after_step"]) <= 1e-5 * abs(saved["loss_after_step"]), name
    assert saved["loss_after_step"] != saved["loss"]


def test_export_hf_from_expert_parallel_checkpoint(world, tmp_path):
    """export_hf turns the ep=2 checkpoint into an HF directory (one tensor per expert) whose
    weights load back bitwise equal to those the expert-parallel trainer held."""
    res = world["from_ep"]
    exported, _ = load_model(export_hf(res["checkpoint"], tmp_path / "hf"))
    exported = dict(exported.named_parameters())
    assert sorted(exported) == sorted(res["saved"]["weights"])
    for n, w in res["saved"]["weights"].items():
        assert torch.equal(exported[n].detach(), w), n


@pytest.mark.parametrize("layout", EXPERT_PARALLEL)
def test_publishing_gathers_full_stacked_experts(world, case, layout):
    """iter_full_weights under ep yields on rank 0 every parameter, the stacked experts [E, out, in]
    gathered whole from their ep (and FSDP) shards, bitwise equal to the checkpoint, in buckets."""
    got = world["publish"][layout]
    model, _ = load_model(case.checkpoint)
    expected = dict(model.named_parameters())
    assert got["names"] == list(expected)
    for n, p in expected.items():
        assert torch.equal(got["weights"][n], p.detach()), n
    assert got["weights"]["model.layers.1.mlp.experts.gate_proj"].shape[0] == 4
    assert len(got["sizes"]) > 1 and all(s >= BUCKET_BYTES for s in got["sizes"][:-1])


@pytest.mark.parametrize("layout", EXPERT_PARALLEL)
def test_sharded_loading_reads_expert_shards(world, layout):
    """build_sharded_policy under ep: every rank's block of every parameter (its experts' rows)
    equals the old path's (full model, then parallelize) and the checkpoint's slice, and one
    gradient pass gives the same loss and gradients."""
    report = world["sharded"][f"moe/{layout}"]
    for rank in report["ranks"]:
        assert rank["unequal_old"] == [] and rank["unequal_ref"] == [] and rank["same_names"], rank
    first = report["ranks"][0]
    assert first["new"]["loss"] == first["old"]["loss"]
    for n, g in first["old"]["grads"].items():
        assert torch.equal(first["new"]["grads"][n], g), n


@pytest.fixture(scope="module")
def world_4(case):
    from parallel_worlds import run_jobs

    results = run_local_world(run_jobs, 4, [("layouts", (LAYOUTS_4, case, reference(case)))], timeout_s=900)[0]
    return results[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS_4)
def test_4_rank_expert_parallel_layout_equals_single_process(world_4, layout):
    """Loss and gradients of the tiny MoE under 4-rank expert-parallel layouts equal GRPOTrainer's to 1e-5."""
    _assert_matches(world_4[layout])
