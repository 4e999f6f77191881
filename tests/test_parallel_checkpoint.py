"""Distributed checkpoints reshard across layouts; HF export and weight publishing from sharded models.

The session's shared 2-process gloo world (conftest's `gloo_world`) runs all checks.
"""

import pytest
import torch

from titanrl.config import ModelConfig
from titanrl.models.hf_checkpoint import load_model
from titanrl.trainer.checkpoint import export_hf
from support.layout_check import make_case
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup

LOADS = {"tp": dict(tp=2), "pp": dict(pp=2), "cp": dict(cp=2)}
TIED_LOADS = {"tp": dict(tp=2), "pp": dict(pp=2)}
"""Where the tied dp_shard=2 checkpoint loads; pp=2 fills both stages' copies of the tied matrix."""
PUBLISH = {"fsdp": dict(dp_shard=2), "tp": dict(tp=2), "pp": dict(pp=2)}
PUBLISH_TIED = {"fsdp": dict(dp_shard=2), "pp": dict(pp=2)}
BUCKET_BYTES = 40_000


def _trainer_losses(case, out_dir):
    """GRPOTrainer, one process: one step, save_state, then (loss at save, loss after one more step)."""
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=case.checkpoint), case.train, case.temperature, seed=0))
    trainer.optimizer_step(trainer.accumulate_gradients(case.batch))
    trainer.save_state(str(out_dir))
    stats = trainer.accumulate_gradients(case.batch)
    loss = stats.loss_sum / stats.tokens
    trainer.optimizer_step(stats)
    stats = trainer.accumulate_gradients(case.batch)
    return loss, stats.loss_sum / stats.tokens


@pytest.fixture(scope="module")
def world(tmp_path_factory, gloo_world):
    """One 2-rank world: save under dp_shard=2, load under tp=2 / pp=2 / cp=2; a tied save under
    dp_shard=2 loaded under tp=2; GRPOTrainer's checkpoint loaded under dp_shard=2; publishing."""
    tmp = tmp_path_factory.mktemp("parallel_ckpt")
    untied, tied = make_case(tmp, tied=False), make_case(tmp, tied=True)
    trainer_losses = _trainer_losses(untied, tmp / "trainer_ckpt")
    jobs = [
        ("resharding", (untied, str(tmp / "untied"), dict(dp_shard=2), LOADS, str(tmp / "trainer_ckpt"))),
        ("resharding", (tied, str(tmp / "tied"), dict(dp_shard=2), TIED_LOADS, None)),
        ("publish", (untied, PUBLISH, BUCKET_BYTES)),
        ("publish", (tied, PUBLISH_TIED, BUCKET_BYTES)),
        ("resharding", (tied, str(tmp / "tied_pp"), dict(pp=2), {"fsdp": dict(dp_shard=2)}, None)),
    ]
    from parallel_worlds import run_jobs

    results = gloo_world.run(run_jobs, jobs, timeout_s=600)
    return {"untied": results[0][0], "tied": results[0][1], "publish": results[0][2],
            "publish_tied": results[0][3], "tied_pp": results[0][4], "publish_rank1": results[1][2],
            "trainer_losses": trainer_losses, "cases": {"untied": untied, "tied": tied, "tied_pp": tied}}


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("kind", ["untied", "tied", "tied_pp"])
def test_checkpoint_saved_with_fsdp_loads_into_other_layouts(world, kind):
    """Saved with dp_shard=2 after a step, loaded with tp=2 and pp=2 (and cp=2 untied): the
    gathered weights are bitwise the saved ones, the loss at load equals the loss at save, and
    one more step (AdamW with the loaded moments) gives the same loss as continuing the saving
    run. tied_pp: the other way round, a tied policy saved with pp=2 (two copies of the tied
    matrix) and loaded with dp_shard=2 (one parameter). A tied pp=2 load that filled only one
    copy, or a moment state lost for the head copy, would change the loss after the step."""
    res = world[kind]
    saved = res["saved"]
    loads = {"untied": LOADS, "tied": TIED_LOADS, "tied_pp": {"fsdp": None}}[kind]
    for name in loads:
        got = res[name]
        assert sorted(got["weights"]) == sorted(saved["weights"])
        for n, w in saved["weights"].items():
            assert torch.equal(got["weights"][n], w), (name, n)
        assert _rel(got["loss"], saved["loss"]) <= 1e-5, (name, got["loss"], saved["loss"])
        assert _rel(got["loss_after_step"], saved["loss_after_step"]) <= 1e-5, name
    assert saved["loss_after_step"] != saved["loss"]  # the extra step changed something


@pytest.mark.parametrize("kind", ["untied", "tied", "tied_pp"])
def test_export_hf_from_sharded_checkpoint(world, kind, tmp_path):
    """titanrl.trainer.checkpoint.export_hf (run, like `titanrl export`, without a process group)
    turns the dp_shard=2 (tied_pp: pp=2) checkpoint into an HF directory whose weights are
    bitwise those the sharded trainer held."""
    res = world[kind]
    exported, _ = load_model(export_hf(res["checkpoint"], tmp_path / "hf"))
    exported = dict(exported.named_parameters())
    assert sorted(exported) == sorted(res["saved"]["weights"])
    for n, w in res["saved"]["weights"].items():
        assert torch.equal(exported[n].detach(), w), n


def test_grpo_trainer_checkpoint_loads_sharded(world):
    """A single-process GRPOTrainer.save_state checkpoint (nested optimizer format) loads under
    dp_shard=2: same loss at load and after one more step as the single-process trainer."""
    loss, loss_after = world["trainer_losses"]
    got = world["untied"]["from_trainer"]
    assert _rel(got["loss"], loss) <= 1e-5 and _rel(got["loss_after_step"], loss_after) <= 1e-5, (got, loss, loss_after)


def test_tied_pipeline_checkpoint_keeps_one_optimizer_state(world):
    """The pp=2 tied checkpoint names its entries as every other tied layout does: the weight
    under model.embed_tokens.weight and lm_head.weight (what GRPOTrainer.load_state and
    export_hf read), the AdamW state only under model.embed_tokens.weight."""
    import torch.distributed.checkpoint as dcp

    keys = set(dcp.FileSystemReader(world["tied_pp"]["checkpoint"] + "/model_optim").read_metadata()
               .state_dict_metadata)
    fsdp_keys = set(dcp.FileSystemReader(world["tied"]["checkpoint"] + "/model_optim").read_metadata()
                    .state_dict_metadata)
    assert {"model.model.embed_tokens.weight", "model.lm_head.weight",
            "optim.state.model.embed_tokens.weight.exp_avg"} <= keys
    assert not [k for k in keys if k.startswith("optim.") and "lm_head" in k], keys
    assert keys == fsdp_keys


@pytest.mark.parametrize("layout", list(PUBLISH) + ["fsdp_tied", "pp_tied"])
def test_iter_full_weights_publishes_hf_state_in_buckets(world, layout):
    """iter_full_weights on a sharded model yields, on rank 0 only, every HF tensor (tied head
    omitted) bitwise equal to the checkpoint, in buckets of >= bucket_bytes except the last."""
    tied = layout.endswith("_tied")
    got = world["publish_tied" if tied else "publish"][layout.removesuffix("_tied")]
    model, _ = load_model(world["cases"]["tied" if tied else "untied"].checkpoint)
    expected = dict(model.named_parameters())  # a tied weight appears once, as HF files hold it
    assert got["names"] == list(expected)
    for n, p in expected.items():
        assert torch.equal(got["weights"][n], p.detach()), n
    assert len(got["sizes"]) > 1 and all(s >= BUCKET_BYTES for s in got["sizes"][:-1])
    assert sum(got["sizes"]) == sum(p.numel() * p.element_size() for p in expected.values())
    if not tied:
        assert world["publish_rank1"][layout]["names"] == []  # only rank 0 receives
