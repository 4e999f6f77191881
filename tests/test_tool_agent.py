"""The tool-agent example: scoring rules, shipped files, and token-level correctness of its
multi-turn training on real episodes (real vLLM, real sandbox, the shipped warm start).

The full GRPO run (warm start -> >= 90 % held-out success) is the command in
examples/tool_agent/README.md; it takes minutes, so it is measured there, not here.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from titanrl.cli import forget_shadowed_modules, load_config_file
from titanrl.config import MemoryConfig, TrainConfig, validate
from titanrl.config.resolve import resolve
from titanrl.models.hf_checkpoint import load_model
from titanrl.trainer.setup import TrainerSetup

from support.episode_tokens import check_training_tokens

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_agent"


@pytest.fixture(scope="module")
def example():
    """The example's task.py and env.py, imported as a run would (its folder on sys.path)."""
    sys.path.insert(0, str(EXAMPLE))
    forget_shadowed_modules(EXAMPLE)  # another example's `task` / `env` may be cached
    import env as env_module
    import task as task_module

    yield task_module, env_module
    sys.path.remove(str(EXAMPLE))


def test_config_validates_and_points_at_shipped_files():
    """`titanrl train examples/tool_agent/config.py` passes validation with the files in the repo."""
    config = load_config_file(str(EXAMPLE / "config.py"))
    validate(config)
    assert Path(config.model.checkpoint) == EXAMPLE / "warm_start"
    assert config.env.factory is not None and config.env.sandbox_pool_size >= 1


def test_shipped_data_is_held_out_and_correct(example):
    """Eval rows never appear in the training file, and every answer is the expression's value."""
    task, _ = example
    train = [json.loads(x) for x in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()]
    assert evals == task.eval_rows()
    assert not {r["expression"] for r in evals} & {r["expression"] for r in train}
    for r in train[:500] + evals:
        assert int(r["answer"]) == eval(r["expression"])  # noqa: S307 - digits and + - * only


def test_warm_start_is_the_configured_model(example):
    """The shipped warm start is an HF checkpoint of MODEL_CONFIG's size."""
    task, _ = example
    _, config = load_model(EXAMPLE / "warm_start")
    for key, value in task.MODEL_CONFIG.items():
        assert getattr(config, key) == value, key


@pytest.mark.own_vllm_engine
def test_warm_start_leaves_room_to_learn():
    """Re-measured, not read back: the shipped warm start's greedy held-out episode success
    (real vLLM engine, real sandbox, the config's eval rows) is at most 40 %."""
    from titanrl.commands.evaluate import evaluate_checkpoint

    config = load_config_file(str(EXAMPLE / "config.py"))
    report = evaluate_checkpoint(config, EXAMPLE / "warm_start")
    assert report.prompts == 100 and report.reward_errors == 0
    assert report.accuracy <= 0.4


def _play(env_module, pool, row: dict, actions: list[str]) -> tuple[float, dict]:
    """Runs scripted model turns through a fresh ToolAgentEnv; returns (reward, episode stats)."""

    async def episode():
        env = env_module.ToolAgentEnv(pool)
        await env.reset(row)
        for action in actions:
            result = await env.step(action)
            if result.done:
                return result.reward, vars(env.stats)
        raise AssertionError("the scripted episode did not end")

    return asyncio.get_event_loop().run_until_complete(episode())


def test_only_a_real_python_call_and_the_exact_answer_earn_reward(example):
    """Reward 1 needs a well-formed `python` call that ran in the sandbox and the exact number;
    no call, a malformed call, a wrong tool, or a wrong number earns 0."""
    task, env_module = example
    from titanrl.envs import SandboxPool

    row = task.row("347 * 829")
    assert row["answer"] == "287663"
    good_call = task.tool_call(row["expression"])
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pool = SandboxPool(size=2)
    loop.run_until_complete(pool.start())
    try:
        reward, stats = _play(env_module, pool, row, [good_call, "287663"])
        assert reward == 1.0 and stats["tool_calls"] == 1 and stats["errors"] == 0 and stats["sandbox_s"] > 0
        assert _play(env_module, pool, row, [good_call, " 287663 <|im_end|>"])[0] == 1.0
        assert _play(env_module, pool, row, [good_call, "287664"])[0] == 0.0
        assert _play(env_module, pool, row, ["287663"])[0] == 0.0  # right number, no call
        wrong_tool = task.tool_call(row["expression"], task.WRONG_TOOL_NAME)
        reward, stats = _play(env_module, pool, row, [wrong_tool, "287663"])
        assert reward == 0.0 and stats["errors"] == 1
        malformed = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"</tool_call>'
        assert _play(env_module, pool, row, [malformed, "287663"])[0] == 0.0
        # The sandbox really ran the model's code: a different program gives a different output.
        env = env_module.ToolAgentEnv(pool)
        loop.run_until_complete(env.reset(row))
        obs = loop.run_until_complete(env.step(task.tool_call("6 * 7"))).observation
        assert "stdout:\n42\n" in obs
    finally:
        loop.run_until_complete(pool.close())
        loop.close()


def _episodes(example, batch_invariant: bool):
    """Real episodes of the shipped warm start: 8 eval rows x 4 samples at T=1, in-process worker."""
    import dataclasses

    from titanrl.rollout.worker import RolloutWorker

    task, _ = example
    config = load_config_file(str(EXAMPLE / "config.py"))
    rollout = dataclasses.replace(config.rollout, group_size=4,
                                  engine=dataclasses.replace(config.rollout.engine, max_num_seqs=32))
    config = dataclasses.replace(config, rollout=rollout, rewards=[], batch_invariant=batch_invariant)
    worker = RolloutWorker(0, resolve(config))
    try:
        batch = worker.generate(task.eval_rows()[:8], seed=7, first_group_id=0)
    finally:
        worker.close()
    return config, batch.groups


@pytest.mark.own_vllm_engine
def test_agent_episodes_train_only_on_model_tokens_and_match_the_generator(example):
    """On real tool-using episodes: observation tokens never carry loss, and the trainer's
    recomputed logprobs match the generator's: exactly (0.0) in batch-invariant mode, and to
    within float32 rounding with the library kernels (vLLM's CPU attention and GEMM blocking
    differ from the trainer's; real runs measure up to ~2e-5 on a rare token, ~1e-7 mean)."""
    from transformers import AutoTokenizer

    from titanrl.trainer.trainer import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE / "warm_start")
    for batch_invariant, bound in ((True, 0.0), (False, 5e-5)):
        config, groups = _episodes(example, batch_invariant)
        tc = TrainConfig(memory=MemoryConfig(micro_batch_size=8))
        trainer = GRPOTrainer(
            TrainerSetup(config.model, tc, config.rollout.sampling.temperature, 0, batch_invariant=batch_invariant)
        )
        check_training_tokens(trainer, groups, tokenizer)
        metrics = trainer.step(groups)
        model_tokens = sum(sum(s.loss_mask) for g in groups for s in g.samples)
        assert metrics["parity/tokens_checked"] == model_tokens
        assert metrics["parity/logprob_diff_max"] <= bound, (batch_invariant, metrics["parity/logprob_diff_max"])
        print(f"batch_invariant={batch_invariant}: {model_tokens} model tokens, "
              f"max |diff| {metrics['parity/logprob_diff_max']:.3g}, mean {metrics['parity/logprob_diff_mean']:.3g}")
