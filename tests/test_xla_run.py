"""End to end with the trainer on XLA: `titanrl.train` with train.compute.device='xla' runs the vLLM CPU
rollout workers in this venv and the trainer actor in .venv-xla on XLA's CPU device.

Skips, saying why, without the XLA venv (`make xla-venv`) or without the XLA step
(titanrl.trainer.xla, issue 19 items 3-4).
"""

import importlib.util

import pytest
import torch

import titanrl
from titanrl.config import ConfigError
from titanrl.config.xla_env import probe_xla_environment, xla_python
from titanrl.models.hf_checkpoint import read_state_dict


@pytest.mark.slow
def test_run_with_the_trainer_on_xla(tmp_path, ray_session, tiny_run):
    """One step (XLA compiles on CPU take tens of seconds): logged with XLA's compile metrics, its
    trainer logprobs equal vLLM's at the initial weights to 1e-4 (the XLA forward is the model's),
    the weights moved and were pushed (the eval after the step ran on version 1)."""
    try:
        probe_xla_environment(str(xla_python(titanrl.TrainConfig(compute=titanrl.ComputeConfig(device="xla")))))
    except ConfigError as e:
        pytest.skip(f"needs the XLA venv: {e}")
    if importlib.util.find_spec("titanrl.trainer.xla") is None:
        pytest.skip("needs the XLA step (titanrl.trainer.xla, issue 19 items 3-4)")
    config = titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
        data=titanrl.DataConfig(train_file=str(tiny_run.train_file), eval_file=str(tiny_run.eval_file(10))),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=4,
            group_size=4,
            sampling=titanrl.SamplingConfig(max_new_tokens=6),
            engine=titanrl.EngineConfig(max_model_len=64),
        ),
        train=titanrl.TrainConfig(
            steps=1, optimizer=titanrl.OptimizerConfig(lr=3e-3), compute=titanrl.ComputeConfig(device="xla")
        ),
        eval=titanrl.EvalConfig(every_steps=1, correct_threshold=0.5),
        output=titanrl.OutputConfig(dir=str(tmp_path / "run"), progress_bar=False),
        rewards=[tiny_run.reward],
    )
    result = titanrl.train(config)

    steps = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1]
    assert isinstance(steps[0]["loss"], float) and steps[0]["xla/compiles"] >= 1
    assert steps[0]["train/mismatch_max_abs"] < 1e-4
    evals = {m["step"]: m["eval/policy_version"] for m in result.metrics if "eval/accuracy" in m}
    assert evals == {0: 0, 1: 1}
    before, after = read_state_dict(config.model.checkpoint), read_state_dict(result.final_checkpoint)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
