"""The math example is complete and consistent: its sample data is what make_data.py writes, in
GSM8K's format with correct answers; its prompts go through the checkpoint's chat template; and
it trains end to end on Parquet shards laid out as the real dataset's (a tiny model, two steps)."""

import json
import sys
from pathlib import Path

import datasets
import pytest

from titanrl.cli import forget_shadowed_modules, load_config_file
from titanrl.config import apply_overrides, validate
from titanrl.data import load_run_rows
from titanrl.rewards import math_answer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "math"


@pytest.fixture(scope="module")
def task():
    sys.path.insert(0, str(EXAMPLE))
    forget_shadowed_modules(EXAMPLE)  # another example's `task` may be cached
    import task as task_module

    yield task_module
    sys.path.remove(str(EXAMPLE))


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / "data" / name).read_text().splitlines()]


def test_shipped_data_is_what_make_data_writes_held_out_and_correct(task, tmp_path):
    """data/ is byte for byte what the generators give; eval questions are not in train; every
    answer ends with `#### N` for the generator's N and scores 1.0 against itself with the reward."""
    from titanrl.data import write_rows

    train, evals = task.splits()
    write_rows(tmp_path / "train.jsonl", train)
    write_rows(tmp_path / "eval.jsonl", evals)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / "data" / name).read_bytes(), name
    assert len(train) == task.TRAIN_SIZE and len(evals) == task.EVAL_SIZE
    assert not {r["question"] for r in evals} & {r["question"] for r in train}
    for row in _rows("train.jsonl")[:50] + _rows("eval.jsonl"):
        assert set(row) == {"question", "answer"}  # GSM8K's columns
        assert row["answer"].splitlines()[-1].startswith("#### ")
        assert math_answer(row["question"], row["answer"], answer=row["answer"]) == 1.0
        assert math_answer(row["question"], "#### -1", answer=row["answer"]) == 0.0


def test_config_validates_and_renders_every_prompt_with_the_chat_template():
    """`titanrl train examples/math/config.py` validates; every sample row fits the budget and
    becomes system prompt + question under the tiny checkpoint's (ChatML) template."""
    config = load_config_file(str(EXAMPLE / "config.py"))
    validate(config)
    assert config.rewards == [math_answer] and config.data.messages_field == "question"
    train, evals = load_run_rows(config)
    assert (len(train), len(evals)) == (256, 64)  # nothing dropped as overlong
    row = train[0]
    assert row["prompt"] == (f"<|im_start|>system\n{config.data.system_prompt}<|im_end|>\n"
                             f"<|im_start|>user\n{row['question']}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_the_example_trains_on_gsm8k_style_parquet_shards(tmp_path, ray_session):
    """Two GRPO steps of the example's config on its rows written as `train-0000K-of-00002.parquet`
    shards read through a glob (the real dataset's layout): both steps logged with the math
    reward, and the rollouts' prompts are the chat-rendered questions."""
    rows = _rows("train.jsonl")
    for k in range(2):
        datasets.Dataset.from_list(rows[k::2]).to_parquet(str(tmp_path / f"train-0000{k}-of-00002.parquet"))
    config = apply_overrides(load_config_file(str(EXAMPLE / "config.py")), [
        f"data.train_file={tmp_path / 'train-*.parquet'}", "data.eval_file=",
        "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.sampling.max_new_tokens=16",
        f"output.dir={tmp_path / 'run'}", "output.progress_bar=false", "output.tensorboard=false",
    ])
    import titanrl

    result = titanrl.train(config)
    steps = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in steps)
    rollouts = [json.loads(line) for line in (result.run_dir / "rollouts.jsonl").read_text().splitlines()]
    questions = {r["question"] for r in rows}
    assert rollouts
    for r in rollouts:
        assert r["prompt"].startswith(f"<|im_start|>system\n{config.data.system_prompt}<|im_end|>\n<|im_start|>user\n")
        assert r["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0] in questions
