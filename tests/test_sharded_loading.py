"""No full model per rank: the parallel trainer builds on the meta device and each rank reads only
its shards, from HF safetensors files (single file or sharded index) or a training checkpoint.

One spawned world of 4 gloo processes runs every check (process start + import torch is ~10 s).
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from titanrl.config import ModelConfig
from titanrl.models.hf_checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    empty_model,
    read_state_dict,
    save_checkpoint,
)
from titanrl.models.tiny import tiny_config, write_tiny_checkpoint
from titanrl.trainer.checkpoint import open_initial_policy
from titanrl.trainer.parallel.launch import run_local_world
from support.layout_check import make_case
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.trainer.setup import TrainerSetup

LAYOUTS = {
    "fsdp+tp": dict(dp_shard=2, tp=2),
    "fsdp4": dict(dp_shard=4),  # the tiny vocabulary (259 rows) splits unevenly over 4 ranks
    "pp+fsdp": dict(pp=2, dp_shard=2),
    "pp+tp": dict(pp=2, tp=2),
}
CASES = ("untied", "tied_index", "tied_trainer_ckpt")
STEPS = {"untied/fsdp+tp", "untied/fsdp4", "tied_index/pp+fsdp", "tied_trainer_ckpt/pp+tp"}
"""Where a GRPO gradient pass is compared too (each layout once; a pass costs seconds on gloo)."""
BF16_LAYOUTS = {"fsdp+tp": LAYOUTS["fsdp+tp"]}
MEMORY_LAYOUT = dict(dp_shard=4)
BIG_MODEL = dict(vocab_size=80_000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
"""~91M parameters (364 MB in float32), most of them the embedding and the LM head."""
SHARDED_MAX_RATIO = 0.6
"""A rank's peak memory increase while loading, at most this fraction of the full model."""


def _as_index(src, dst):
    """The checkpoint `src` rewritten as a two-file sharded index checkpoint in `dst`."""
    state = read_state_dict(src)
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    dst.mkdir()
    for fname, keys in files.items():
        save_file({k: state[k] for k in keys}, str(dst / fname))
    (dst / INDEX_FILE).write_text(json.dumps({"weight_map": {k: f for f, ks in files.items() for k in ks}}))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _write_big_checkpoint(out_dir):
    """An HF checkpoint of BIG_MODEL with uniform random weights (quicker to make than init_weights)."""
    model = empty_model(tiny_config(**BIG_MODEL))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.05, 0.05, generator=gen)
    return save_checkpoint(model, out_dir)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Tiny policies: untied in one file, tied as a sharded index, and a tied training checkpoint
    saved by the single-process trainer after one step; a ~360 MB model for the memory check."""
    tmp = tmp_path_factory.mktemp("sharded_loading")
    untied, tied = make_case(tmp, tied=False), make_case(tmp, tied=True)
    tied_index = _as_index(tmp / "tied", tmp / "tied_index")
    trainer = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=tied.checkpoint), tied.train, tied.temperature, seed=0))
    trainer.optimizer_step(trainer.accumulate_gradients(tied.batch))
    trainer.save_state(str(tmp / "trainer_ckpt"))
    del trainer
    cases = {"untied": (untied.checkpoint, untied), "tied_index": (str(tied_index), tied),
             "tied_trainer_ckpt": (str(tmp / "trainer_ckpt"), tied)}
    big = _write_big_checkpoint(tmp / "big")
    model_mb = (big / SINGLE_FILE).stat().st_size / 2**20
    jobs = [
        ("sharded_load_memory", (str(big), str(tmp / "memory"), MEMORY_LAYOUT)),
        ("sharded_loading", (cases, LAYOUTS, {}, STEPS)),
        ("sharded_loading", ({"untied": cases["untied"]}, BF16_LAYOUTS, {"untied": "bfloat16"}, set())),
    ]
    from parallel_worlds import run_jobs

    results = run_local_world(run_jobs, 4, jobs, timeout_s=600)
    return {"memory": [r[0] for r in results], "model_mb": model_mb, "layouts": results[0][1],
            "bf16": results[0][2]}


@pytest.mark.parametrize("key", [f"{c}/{lay}" for c in CASES for lay in LAYOUTS])
def test_sharded_parameters_are_the_checkpoint_slices(world, key):
    """Every parameter on every rank, loaded shard by shard, is bitwise the old path's (full model
    read on every rank, then parallelize) and the checkpoint tensor's slice at its DTensor offset;
    a pipeline split of a tied matrix fills both copies from the embedding."""
    for rank, report in enumerate(world["layouts"][key]["ranks"]):
        assert report["checked"] > 0 and report["same_names"], rank
        assert report["unequal_old"] == [] and report["unequal_ref"] == [], (rank, report)


@pytest.mark.parametrize("key", sorted(STEPS))
def test_sharded_load_trains_like_the_full_load(world, key):
    """One GRPO gradient pass after the sharded load gives the same loss and bitwise the same
    gathered gradients as after the old path's load."""
    rank0 = world["layouts"][key]["ranks"][0]
    new, old = rank0["new"], rank0["old"]
    assert new["loss"] == old["loss"]
    assert sorted(new["grads"]) == sorted(old["grads"]) and new["grads"]
    for name, grad in old["grads"].items():
        assert torch.equal(new["grads"][name], grad), name
    assert any(g.abs().sum() > 0 for g in new["grads"].values())


def test_sharded_load_casts_slices_to_the_storage_dtype(world):
    """A float32 checkpoint loaded as bfloat16 under fsdp+tp holds, on every rank, the same bits as
    the old path's full load cast to bfloat16."""
    for rank, report in enumerate(world["bf16"]["untied/fsdp+tp"]["ranks"]):
        assert report["checked"] > 0 and report["unequal_old"] == [] and report["unequal_ref"] == [], rank


def test_rank_peak_memory_is_well_under_the_full_model(world):
    """dp_shard=4: each rank's peak resident memory increase while loading (VmHWM) stays under
    0.6x the model's size, from the HF file and from a training checkpoint saved in this layout;
    a full load (what every rank used to make first; measured on rank 0) reaches the model's size,
    so the instrument sees a full copy when there is one."""
    model_mb = world["model_mb"]
    for rank, mem in enumerate(world["memory"]):
        assert mem["hf_sharded_mb"] < SHARDED_MAX_RATIO * model_mb, (rank, mem, model_mb)
        assert mem["dcp_sharded_mb"] < SHARDED_MAX_RATIO * model_mb, (rank, mem, model_mb)
    # Measured ~1.02x: RSS grows by the model, less what freed heap pages it reuses.
    assert world["memory"][0]["full_load_mb"] > 0.9 * model_mb, (world["memory"][0], model_mb)


def test_bad_checkpoints_fail_before_any_weight_is_read(tmp_path):
    """open_initial_policy (what a parallel rank runs before joining the world) names a missing
    tensor and a mis-shaped one from the safetensors headers, for a single file and an index."""
    ckpt = write_tiny_checkpoint(tmp_path / "a")
    state = read_state_dict(ckpt)
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(ckpt / SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        open_initial_policy(str(ckpt))
    save_file({**state, name: state[name][:-1]}, str(ckpt / SINGLE_FILE))
    index = _as_index(ckpt, tmp_path / "b")
    for bad in (ckpt, index):
        with pytest.raises(CheckpointError, match=rf"{name} has shape \({state[name].shape[0] - 1}, "):
            open_initial_policy(str(bad))
