"""The embedded-default example is complete and consistent (its full run is `make demo`)."""

import json
import sys
from pathlib import Path

import pytest

from titanrl.cli import forget_shadowed_modules, load_config_file
from titanrl.config import validate
from titanrl.models.hf_checkpoint import load_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic"


@pytest.fixture(scope="module")
def task():
    sys.path.insert(0, str(EXAMPLE))
    forget_shadowed_modules(EXAMPLE)  # another example's `task` / `env` may be cached
    import task as task_module

    yield task_module
    sys.path.remove(str(EXAMPLE))


def test_config_validates_and_points_at_shipped_files():
    """`titanrl train examples/arithmetic/config.py` passes validation with the files in the repo."""
    config = load_config_file(str(EXAMPLE / "config.py"))
    validate(config)
    assert Path(config.model.checkpoint) == EXAMPLE / "warm_start"


def test_reward_is_exact_match(task):
    """The reward accepts the exact sum (surrounding whitespace aside) and nothing else."""
    assert task.reward("12+30=", "42", answer="42") == 1.0
    assert task.reward("12+30=", " 42\n", answer="42") == 1.0
    assert task.reward("12+30=", "420", answer="42") == 0.0
    assert task.reward("12+30=", "", answer="42") == 0.0


def test_shipped_data_is_held_out_and_correct(task):
    """Eval rows never appear in the training file, and every answer is the true sum."""
    train = [json.loads(x) for x in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()]
    assert evals == task.eval_rows()
    assert not {r["prompt"] for r in evals} & {r["prompt"] for r in train}
    for r in train[:500] + evals:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["answer"]) == int(a) + int(b)


def test_warm_start_loads_with_our_model(task):
    """The shipped warm start is an HF checkpoint of the configured size that our loader reads."""
    model, config = load_model(EXAMPLE / "warm_start")
    for key, value in task.MODEL_CONFIG.items():
        assert getattr(config, key) == value, key


@pytest.mark.own_vllm_engine
def test_warm_start_is_sometimes_right_with_room_to_learn():
    """Measured as `titanrl eval` measures it (a vLLM rollout worker, the example's reward, greedy,
    its 200 held-out rows): the warm start answers some sums right, so GRPO groups have mixed
    rewards, and at most 40 %, so the demo has room to show learning."""
    from titanrl.commands.evaluate import evaluate_checkpoint

    report = evaluate_checkpoint(load_config_file(str(EXAMPLE / "config.py")), EXAMPLE / "warm_start")
    assert report.prompts == 200 and report.reward_errors == 0
    assert 0.05 <= report.accuracy <= 0.4, report.accuracy
