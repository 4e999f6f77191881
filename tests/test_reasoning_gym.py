"""reasoning-gym as a data source and a reward (titanrl.data_sources.reasoning_gym,
titanrl.rewards.reasoning_gym): rows are reproducible, train and held-out are disjoint, a bad
task or task config is refused naming the field before a run is configured, the task's own
checker scores the `<answer>` block (correct 1, wrong 0, missing 0), the format term is its own
reward, the "last_line" answer convention (`Answer: N`) travels in the rows to both rewards, and
rows render through a tiny checkpoint's chat template. No network: reasoning-gym generates every
task locally."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings

import pytest

from titanrl.config import ConfigError, EngineConfig, ModelConfig, RolloutConfig, RunConfig, SamplingConfig, validate
from titanrl.data import load_rows, load_run_rows
from titanrl.data_sources import plain_json
from titanrl.data_sources.reasoning_gym import (ANSWER_INSTRUCTION, LAST_LINE_INSTRUCTION, final_answer,
                                                last_line_answer, reasoning_gym_data, reasoning_gym_rows)
from titanrl.rewards.named import reward_names
from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format, reasoning_gym_score

SMALL_CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
"""chain_sum with two one-digit terms: 200 distinct questions, so splits of a few hundred rows collide."""


def _digest(rows) -> str:
    return hashlib.sha256(json.dumps(rows.to_list(), sort_keys=True).encode()).hexdigest()


def _wrong(answer: str) -> str:
    """A different number than `answer` (an integer as text)."""
    return str(int(answer) + 1)


# ----------------------------------------------------------------------------- rows


def test_the_same_seed_gives_the_same_rows_in_any_process():
    """Two calls with the same arguments give identical rows (every field), a new interpreter with
    another hash seed gives the same bytes (what a resumed run regenerates), and another seed
    gives other questions."""
    args = dict(seed=7, train_size=40, eval_size=10)
    train, held_out = reasoning_gym_rows("gsm_symbolic", **args)
    again_train, again_held_out = reasoning_gym_rows("gsm_symbolic", **args)
    assert train.to_list() == again_train.to_list() and held_out.to_list() == again_held_out.to_list()
    assert len(train) == 40 and len(held_out) == 10

    code = ("import hashlib, json; from titanrl.data_sources.reasoning_gym import reasoning_gym_rows; "
            "t, e = reasoning_gym_rows('gsm_symbolic', seed=7, train_size=40, eval_size=10); "
            "print(*(hashlib.sha256(json.dumps(d.to_list(), sort_keys=True).encode()).hexdigest() for d in (t, e)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [_digest(train), _digest(held_out)]

    other, _ = reasoning_gym_rows("gsm_symbolic", seed=8, train_size=40, eval_size=10)
    assert {r["question"] for r in other} != {r["question"] for r in train}


def test_train_and_held_out_are_disjoint():
    """Held-out rows never repeat a training question: with a config of 200 possible questions
    the colliding held-out rows are dropped (one warning with the count); with a large one none
    is; and when every held-out question is a training one the source refuses."""
    with pytest.warns(UserWarning, match=r"dropped \d+ of 100 held-out rows") as caught:
        train, held_out = reasoning_gym_rows("chain_sum", SMALL_CHAIN, seed=0, train_size=150, eval_size=100)
    assert len(caught) == 1
    train_questions = {r["question"] for r in train}
    assert len(train) == 150 and 0 < len(held_out) < 100
    assert not train_questions & {r["question"] for r in held_out}
    dropped = int(str(caught[0].message).split("dropped ")[1].split()[0])
    assert len(held_out) == 100 - dropped

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped, so no warning
        train, held_out = reasoning_gym_rows("basic_arithmetic", seed=0, train_size=300, eval_size=100)
    assert len(held_out) == 100 and not {r["question"] for r in train} & {r["question"] for r in held_out}

    with pytest.raises(ConfigError, match="every one of the 5 held-out questions is also a training question"):
        reasoning_gym_rows("chain_sum", SMALL_CHAIN, seed=0, train_size=3000, eval_size=5)


@pytest.mark.parametrize(("task", "config", "kwargs", "message"), [
    ("chain_sums", {}, {}, r"task 'chain_sums' is not a reasoning-gym task; did you mean 'chain_sum'"),
    ("composite", {}, {}, r"task 'composite' is not a single task"),
    ("chain_sum", {"min_term": 2}, {}, r"config\['min_term'\] is not a field of 'chain_sum'.*did you mean 'min_terms'"),
    ("chain_sum", {"min_terms": "2"}, {}, r"config\['min_terms'\] = '2' for task 'chain_sum': expected int, got str"),
    ("chain_sum", {"min_terms": 0}, {}, r"config\['min_terms'\] for task 'chain_sum' is invalid: min_terms must be "
                                        r"positive"),
    ("chain_sum", {"min_terms": 5, "max_terms": 3}, {}, r"config\['max_terms'\] for task 'chain_sum' is invalid"),
    ("chain_sum", {"seed": 1}, {}, r"config\['seed'\] is set by the source itself"),
    ("chain_sum", [2, 4], {}, r"config must be a dict of 'chain_sum''s config fields, got list"),
    ("chain_sum", {}, {"seed": -1}, r"reasoning_gym seed must be an integer >= 0, got -1"),
    ("chain_sum", {}, {"train_size": 0}, r"reasoning_gym train_size must be an integer >= 1, got 0"),
    ("chain_sum", {}, {"answer_format": "lastline"}, r"reasoning_gym answer_format must be one of 'tags', "
                                                     r"'last_line', got 'lastline'"),
    ("chain_sum", {}, {"answer_format": None}, r"reasoning_gym answer_format must be one of .*, got None"),
])
def test_a_bad_task_or_task_config_fails_naming_the_field(task, config, kwargs, message):
    """An unknown task name, a key the task's config lacks, a value of the wrong type or one the
    config's validate() rejects, a reserved key, and bad sizes: a ConfigError naming the field,
    raised while the DataConfig is built (before validation, let alone any actor)."""
    with pytest.raises(ConfigError, match=message):
        reasoning_gym_data(task, config, **{"train_size": 4, "eval_size": 2, **kwargs})


def test_rows_carry_what_the_checker_needs_through_parquet(tmp_path):
    """A row is chat messages plus plain-string fields (task, answer, JSON task config and
    metadata); written to Parquet and read back through titanrl.data (datasets), rows are
    unchanged and the metadata decodes to the entry's own (tuples included)."""
    import reasoning_gym

    train, _ = reasoning_gym_rows("chain_sum", {"min_terms": 3, "max_terms": 4}, seed=2, train_size=6, eval_size=0)
    row = train[0]
    assert set(row) == {"messages", "question", "answer", "task", "task_config", "metadata", "answer_format"}
    assert row["answer_format"] == "tags"  # the default convention, reasoning-gym's own
    assert row["messages"] == [{"role": "user", "content": f"{row['question']}\n\n{ANSWER_INSTRUCTION}"}]
    assert row["task"] == "chain_sum"
    assert plain_json.loads(row["task_config"]) == {"min_terms": 3, "max_terms": 4, "seed": 2, "size": 6}
    entry = reasoning_gym.create_dataset("chain_sum", min_terms=3, max_terms=4, seed=2, size=6)[0]
    assert (row["question"], row["answer"]) == (entry["question"], entry["answer"])
    assert plain_json.loads(row["metadata"]) == entry["metadata"]
    assert isinstance(plain_json.loads(row["metadata"])["difficulty"]["num_terms"], tuple)

    train.to_parquet(str(tmp_path / "train.parquet"))
    assert load_rows(str(tmp_path / "train.parquet"), messages_field="messages") == train.to_list()


# ----------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("task", ["chain_sum", "gsm_symbolic"])
def test_the_checker_scores_correct_1_wrong_0_missing_0(task):
    """For held-out rows of each task: the reference in an answer block scores 1, another number
    0, the right number without an answer block 0 (the convention is the tags), and the last
    block is the one read. `reasoning_gym_score` keeps the checker's partial credit."""
    _, held_out = reasoning_gym_rows(task, seed=3, train_size=20, eval_size=8)
    for row in held_out:
        answer = row["answer"]
        assert reasoning_gym_answer("", f"Let me compute.\n<answer>{answer}</answer>", **row) == 1.0
        assert reasoning_gym_answer("", f"Let me compute.\n<answer>{_wrong(answer)}</answer>", **row) == 0.0
        assert reasoning_gym_answer("", f"The answer is {answer}.", **row) == 0.0
        last_counts = f"<answer>{_wrong(answer)}</answer> no: <answer>{answer}</answer>"
        assert reasoning_gym_answer("", last_counts, **row) == 1.0
        assert reasoning_gym_score("", f"<answer>{answer}</answer>", **row) == 1.0
        assert reasoning_gym_score("", f"The answer is {answer}.", **row) == 0.0
    row = held_out[0]
    if task == "gsm_symbolic":  # the checker's 0.01 for any wrong number
        assert reasoning_gym_score("", f"<answer>{_wrong(row['answer'])}</answer>", **row) == 0.01
    else:  # the reference inside a longer answer: len(reference) / len(answer)
        padded = f"{row['answer']} or 5"
        assert reasoning_gym_score("", f"<answer>{padded}</answer>", **row) == len(row["answer"]) / len(padded)
        assert reasoning_gym_answer("", f"<answer>{padded}</answer>", **row) == 0.0
    with pytest.raises(ValueError, match="needs the row fields 'task', 'task_config' and 'metadata'"):
        reasoning_gym_answer("", "<answer>1</answer>", answer="1")


def test_the_format_reward_is_separate_from_correctness():
    """`reasoning_gym_format` is 1 only for one non-empty answer block at the end, whatever the
    answer; the two rewards get distinct metric names; `final_answer` reads blocks as
    reasoning_gym.utils.extract_answer does."""
    from reasoning_gym.utils import extract_answer

    (row,), _ = reasoning_gym_rows("chain_sum", seed=1, train_size=1, eval_size=0)
    answer, wrong = row["answer"], _wrong(row["answer"])
    cases = {  # completion: (format, answer)
        f"Adding up.\n<answer>{answer}</answer>": (1.0, 1.0),
        f"<answer> {wrong} </answer>\n": (1.0, 0.0),
        f"<answer>{answer}</answer> because I added.": (0.0, 1.0),
        f"<answer>{wrong}</answer><answer>{answer}</answer>": (0.0, 1.0),
        "<answer> </answer>": (0.0, 0.0),
        f"<answer>{answer}": (0.0, 0.0),
        f"{answer}": (0.0, 0.0),
    }
    for completion, (fmt, correct) in cases.items():
        assert reasoning_gym_format("", completion, **row) == fmt, completion
        assert reasoning_gym_answer("", completion, **row) == correct, completion
        assert final_answer(completion) == extract_answer(completion), completion
    assert reward_names([reasoning_gym_answer, reasoning_gym_format, reasoning_gym_score]) == [
        "reasoning_gym_answer", "reasoning_gym_format", "reasoning_gym_score"]


# ----------------------------------------------------------------------------- the "last_line" convention


LAST_LINE_CASES = {  # completion (with {a} the reference, {w} a wrong number): (format, answer)
    "2 + 3 makes 5.\nAnswer: {a}": (1.0, 1.0),
    "Answer: {a}\n\n": (1.0, 1.0),
    "answer:{a}": (1.0, 1.0),
    "  ANSWER :  {a}  ": (1.0, 1.0),
    "Adding.\n**Answer:** {a}": (1.0, 1.0),
    "**Answer**: {a}": (1.0, 1.0),
    "*Answer:* {a}": (1.0, 1.0),
    "**Answer: {a}**": (1.0, 1.0),
    "Answer: **{a}**.": (1.0, 1.0),
    "Answer: {a}.": (1.0, 1.0),
    "Answer: **{a}.**": (1.0, 1.0),
    "Answer: {w}": (1.0, 0.0),                          # well formed, wrong
    "Answer: {w}\nAnswer: {a}": (0.0, 1.0),             # the last answer line counts; two lines are bad form
    "Answer: {a}\nAnswer: {w}": (0.0, 0.0),
    "Answer: {a}\nI added the two numbers.": (0.0, 1.0),  # text after the line: read, but bad form
    "Answer:": (0.0, 0.0),                              # an empty answer is none
    "Answer: {w}\nAnswer:": (0.0, 0.0),                 # ... and it is the last answer line
    "The answer is {a}.": (0.0, 0.0),                   # missing: no answer line
    "So the sum is {a}. Answer: {a}": (0.0, 0.0),       # mid-line is not an answer line
    "Final answer: {a}": (0.0, 0.0),
    "Answer - {a}": (0.0, 0.0),
    "<answer>{a}</answer>": (0.0, 0.0),                 # the other convention (negative control below)
    "{a}": (0.0, 0.0),
}


def test_last_line_rows_ask_for_an_answer_line_and_carry_the_convention():
    """answer_format="last_line" puts LAST_LINE_INSTRUCTION after the question and the name of the
    convention in every row (train and held-out), so the rewards read what the prompt asked for;
    the questions are those of the default convention's rows."""
    args = dict(seed=4, train_size=6, eval_size=3)
    train, held_out = reasoning_gym_rows("chain_sum", {"max_terms": 3}, answer_format="last_line", **args)
    tags_train, _ = reasoning_gym_rows("chain_sum", {"max_terms": 3}, **args)
    assert 'final line of the form "Answer: <answer>"' in LAST_LINE_INSTRUCTION
    for row in list(train) + list(held_out):
        assert row["answer_format"] == "last_line"
        assert row["messages"] == [{"role": "user", "content": f"{row['question']}\n\n{LAST_LINE_INSTRUCTION}"}]
    assert [r["question"] for r in train] == [r["question"] for r in tags_train]
    data = reasoning_gym_data("chain_sum", seed=0, train_size=4, eval_size=2, answer_format="last_line")
    assert {r["answer_format"] for r in list(data.train_rows) + list(data.eval_rows)} == {"last_line"}


@pytest.mark.parametrize("task", ["chain_sum", "gsm_symbolic"])
def test_last_line_checker_scores_correct_1_wrong_0_missing_0(task):
    """On "last_line" rows the task's checker scores the last `Answer:` line: the reference 1
    (markdown bold, a trailing period and whitespace tolerated), another number 0, no answer line 0.
    Negative control: the same correct answers in the other convention score 0 on each side, so it
    is the row's convention, not a lenient parser, that decides."""
    _, held_out = reasoning_gym_rows(task, seed=3, train_size=20, eval_size=8, answer_format="last_line")
    _, tags_rows = reasoning_gym_rows(task, seed=3, train_size=20, eval_size=8)
    for row, tags_row in zip(held_out, tags_rows, strict=True):
        answer, wrong = row["answer"], _wrong(row["answer"])
        assert reasoning_gym_answer("", f"Let me compute.\nAnswer: {answer}", **row) == 1.0
        assert reasoning_gym_answer("", f"Let me compute.\n**Answer:** {answer}.", **row) == 1.0
        assert reasoning_gym_answer("", f"Let me compute.\nAnswer: {wrong}", **row) == 0.0
        assert reasoning_gym_answer("", f"The answer is {answer}.", **row) == 0.0
        assert reasoning_gym_score("", f"Answer: {answer}", **row) == 1.0
        # negative control: each convention's correct answer, scored under the other
        assert reasoning_gym_answer("", f"<answer>{answer}</answer>", **row) == 0.0
        assert reasoning_gym_answer("", f"<answer>{answer}</answer>", **tags_row) == 1.0
        assert reasoning_gym_answer("", f"Answer: {answer}", **tags_row) == 0.0
        assert reasoning_gym_format("", f"Answer: {answer}", **tags_row) == 0.0
        assert reasoning_gym_format("", f"<answer>{answer}</answer>", **row) == 0.0


def test_last_line_format_and_answer_cases():
    """Every accepted and refused form of the answer line (LAST_LINE_CASES), for the format reward
    (exactly one non-empty answer line, nothing after it) and the answer reward (the last answer
    line's answer, whatever follows); `final_answer(..., "last_line")` is `last_line_answer`."""
    (row,), _ = reasoning_gym_rows("chain_sum", seed=1, train_size=1, eval_size=0, answer_format="last_line")
    answer, wrong = row["answer"], _wrong(row["answer"])
    for template, (fmt, correct) in LAST_LINE_CASES.items():
        completion = template.format(a=answer, w=wrong)
        assert reasoning_gym_format("", completion, **row) == fmt, completion
        assert reasoning_gym_answer("", completion, **row) == correct, completion
        assert final_answer(completion, "last_line") == last_line_answer(completion), completion
    assert last_line_answer("x\n**Answer: 3.5**") == "3.5"  # a decimal point is not a trailing period
    assert last_line_answer("Answer: -7.\n") == "-7"
    assert last_line_answer("Answered: 3") is None


def test_an_unknown_answer_format_in_a_row_is_a_dataset_error():
    """A row whose answer_format is not a convention raises in both rewards (a dataset error, not a
    wrong answer); a row without the field (written before it existed) is "tags"."""
    (row,), _ = reasoning_gym_rows("chain_sum", seed=1, train_size=1, eval_size=0)
    for reward in (reasoning_gym_answer, reasoning_gym_format):
        with pytest.raises(ValueError, match="answer_format 'boxed' is not one of 'tags', 'last_line'"):
            reward("", "Answer: 1", **{**row, "answer_format": "boxed"})
    old = {k: v for k, v in row.items() if k != "answer_format"}
    assert reasoning_gym_answer("", f"<answer>{row['answer']}</answer>", **old) == 1.0
    assert reasoning_gym_format("", f"<answer>{row['answer']}</answer>", **old) == 1.0


def test_eval_counts_a_completion_correct_only_when_the_answer_reward_is_1():
    """What eval/accuracy counts with rewards [answer, format] weighted [1.0, 0.1] (the scorer the
    rollout workers use, and eval.correct_threshold's default 1.0): a right answer with or without
    the format, not a well-formed wrong one (0.1)."""
    from titanrl.rewards.batch_scoring import RewardScorer, ToScore
    from titanrl.rewards.scoring import is_correct

    (row,), _ = reasoning_gym_rows("chain_sum", seed=1, train_size=1, eval_size=0, answer_format="last_line")
    answer, wrong = row["answer"], _wrong(row["answer"])
    completions = {f"Answer: {answer}": (1.1, True), f"Answer: {answer}\nDone.": (1.0, True),
                   f"Answer: {wrong}": (0.1, False), "no idea": (0.0, False)}
    fields = {k: v for k, v in row.items() if k != "prompt"}
    scorer = RewardScorer([reasoning_gym_answer, reasoning_gym_format], timeout_s=None, error_value=0.0,
                          weights=[1.0, 0.1])
    try:
        scored = scorer.score([ToScore("", c, fields) for c in completions])
    finally:
        scorer.close()
    for (completion, (total, correct)), (reward, error) in zip(completions.items(), scored, strict=True):
        assert error is None and reward == pytest.approx(total), completion
        assert is_correct(reward, error, 1.0) is correct, completion


def test_a_config_of_reasoning_gym_rows_takes_command_line_overrides():
    """`titanrl train CONFIG.py [--key=value ...]` and its --help pass the config through tyro, which
    refused a `datasets.Dataset` in data.train_rows (a pyarrow Table inside: exit 2, even with no
    override): the in-memory rows are set aside and come back as they were."""
    from titanrl.config import apply_overrides
    from titanrl.config.help import config_help

    config = RunConfig(data=reasoning_gym_data("chain_sum", seed=0, train_size=4, eval_size=2,
                                               answer_format="last_line"))
    for overrides in ([], ["train.optimizer.lr=1e-4", "data.system_prompt=Be brief."]):
        out = apply_overrides(config, overrides)
        assert out.data.train_rows is config.data.train_rows and out.data.eval_rows is config.data.eval_rows
    assert (out.train.optimizer.lr, out.data.system_prompt, config.data.system_prompt) == (1e-4, "Be brief.", "")
    assert "--data.train_rows" in config_help(config)


# ----------------------------------------------------------------------------- chat template


def test_rows_render_through_a_tiny_llama_chat_template(tmp_path):
    """A run config of reasoning-gym rows validates, and load_run_rows (what the driver runs
    before any actor) renders each row's messages with a tiny random Llama checkpoint's chat
    template (the byte tokenizer's ChatML), after the system prompt, keeping the reward's fields."""
    from titanrl.models.tiny import tiny_config, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "llama", tiny_config(family="llama"))
    config = RunConfig(
        model=ModelConfig(checkpoint=str(ckpt)),
        data=reasoning_gym_data("chain_sum", {"max_terms": 3}, seed=0, train_size=8, eval_size=4,
                                system_prompt="Be brief."),
        rollout=RolloutConfig(sampling=SamplingConfig(max_new_tokens=32), engine=EngineConfig(max_model_len=512)),
        rewards=[reasoning_gym_answer, reasoning_gym_format], reward_weights=[1.0, 0.1],
    )
    validate(config)
    train, held_out = load_run_rows(config)
    assert (len(train), len(held_out)) == (8, 4)  # nothing dropped as overlong
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    for row in train + held_out:
        assert row["prompt"] == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{row['question']}\n\n"
                                 f"{ANSWER_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
        fields = {k: v for k, v in row.items() if k != "prompt"}  # what a reward receives
        assert reasoning_gym_answer(row["prompt"], f"<answer>{row['answer']}</answer>", **fields) == 1.0
