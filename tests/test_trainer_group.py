"""The parallel trainer as a group of Ray actors, run by the driver like the single-process one."""

import pytest
import torch

import titanrl
from titanrl.config import ConfigError, ParallelConfig
from titanrl.models.hf_checkpoint import hf_state_dict, read_state_dict
from titanrl.trainer.checkpoint import HF_CONFIG_DIR, MODEL_OPTIM_DIR, TRAINER_STATE_FILE, load_policy
from titanrl.trainer.trainer_group import TrainerGroup
from titanrl.trainer.setup import TrainerSetup


def _config(tmp_path, tiny_run, name: str, parallel: ParallelConfig, steps: int, **top) -> titanrl.RunConfig:
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
        data=titanrl.DataConfig(train_file=str(tiny_run.train_file)),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=4,
            group_size=4,
            sampling=titanrl.SamplingConfig(max_new_tokens=6),
            engine=titanrl.EngineConfig(max_model_len=64),
        ),
        train=titanrl.TrainConfig(
            steps=steps,
            optimizer=titanrl.OptimizerConfig(lr=3e-3),
            memory=titanrl.MemoryConfig(micro_batch_size=5),
            parallel=parallel,
        ),
        eval=titanrl.EvalConfig(every_steps=0),
        output=titanrl.OutputConfig(
            dir=str(tmp_path / name), progress_bar=False, tensorboard=False, save_every_steps=1
        ),
        rewards=[tiny_run.reward],
        **top,
    )


@pytest.mark.slow
def test_fsdp_trainer_group_matches_single_process_run(tmp_path, ray_session, tiny_run):
    """dp_shard=2 through titanrl.train: step 1's loss equals the single-process run's (same seed,
    same rollouts) within 1e-5 relative, the run finishes, saves its collective training
    checkpoints in GRPOTrainer's layout, and exports a changed HF policy; a tp=2 group then
    loads that dp_shard=2 checkpoint and pushes exactly its weights."""
    single = titanrl.train(_config(tmp_path, tiny_run, "single", ParallelConfig(), steps=1))
    group = titanrl.train(_config(tmp_path, tiny_run, "fsdp", ParallelConfig(dp_shard=2), steps=2))

    (ref,) = [m for m in single.metrics if m["step"] == 1]
    steps = [m for m in group.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    # The token-mean loss is a sum of +-advantage terms of size ~1 that nearly cancel (it is ~5e-8
    # here), so float32 summation order alone moves it by ~5e-9: compare on the terms' scale.
    assert abs(steps[0]["loss"] - ref["loss"]) <= 1e-5 * max(abs(ref["loss"]), 1e-2), (steps[0]["loss"], ref["loss"])
    assert steps[0]["train/tokens"] == ref["train/tokens"]  # the same rollouts
    assert [m["policy_version"] for m in steps] == [1.0, 2.0]
    assert steps[1]["train/mismatch_max_abs"] < 1e-4  # the pushed (gathered) weights reached vLLM

    ckpts = sorted(p for p in group.run_dir.rglob(TRAINER_STATE_FILE))
    assert ckpts, "no training checkpoint written"
    trainer_dir = ckpts[-1].parent
    assert (trainer_dir / MODEL_OPTIM_DIR / ".metadata").is_file() and (trainer_dir / HF_CONFIG_DIR).is_dir()
    before = read_state_dict(tiny_run.checkpoint)
    after = read_state_dict(group.final_checkpoint)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # That checkpoint resumes into another layout: a tp=2 group holds exactly its weights.
    tp = (
        ray_session.remote(TrainerGroup)
        .options(num_cpus=0)
        .remote(
            TrainerSetup(
                titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
                titanrl.TrainConfig(parallel=ParallelConfig(tp=2)),
                1.0,
                0,
            )
        )
    )
    try:
        version = ray_session.get(tp.load_state.remote(str(trainer_dir)))
        pushed = ray_session.get(tp.state_dict_for_push.remote())
    finally:
        ray_session.kill(tp)
    saved = hf_state_dict(load_policy(trainer_dir)[0])
    assert version == int(trainer_dir.parent.name.removeprefix("step_"))
    assert pushed.keys() == saved.keys()
    assert all(torch.equal(pushed[k], saved[k]) for k in saved)


def test_bad_layouts_fail_before_any_actor_starts(tmp_path, tiny_run):
    """A layout the model cannot take, and batch-invariant mode with tensor parallelism, raise a
    ConfigError naming the field before the run directory (or any actor) exists."""
    with pytest.raises(ConfigError, match=r"train\.parallel\.tp=3 must divide"):
        titanrl.train(_config(tmp_path, tiny_run, "bad_tp", ParallelConfig(tp=3), steps=1))
    with pytest.raises(ConfigError, match=r"batch_invariant=True .* tp=2"):
        titanrl.train(_config(tmp_path, tiny_run, "bi_tp", ParallelConfig(tp=2), steps=1, batch_invariant=True))
    assert not (tmp_path / "bad_tp").exists() and not (tmp_path / "bi_tp").exists()
