"""The reasoning example's configs load and validate without a run (its real run is `make reasoning`):
a tiny random Llama checkpoint stands in for SmolLM2-135M-Instruct (through $REASONING_CHECKPOINT,
or in place of `titanrl models get`), so nothing is installed or converted, and no engine starts.
`titanrl eval` on eval_gsm.py is checked with a stand-in rollout worker: it scores the config's
in-memory eval rows with the config's reward weights, as a run's eval/accuracy does."""

import sys
from pathlib import Path

import pytest

from titanrl.cli import load_config_file
from titanrl.config import apply_overrides, validate
from titanrl.data import load_run_rows
from titanrl.data_sources.reasoning_gym import LAST_LINE_INSTRUCTION
from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reasoning"
BYTE_TOKENS = ["rollout.engine.max_model_len=2048"]
"""The stand-in's byte tokenizer makes a token of every byte (a chain_sum prompt is ~240 tokens of it,
~85 of SmolLM2's), so its prompts need a longer context than the example's."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from titanrl.models.tiny import tiny_config, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("reasoning") / "llama", tiny_config(family="llama"))


@pytest.fixture
def no_fetching(monkeypatch):
    """Fails the test if the config tries to install or convert a model."""
    import titanrl.commands.models as models

    def refuse(*args, **kwargs):
        raise AssertionError(f"get_model{args} was called")

    monkeypatch.setattr(models, "get_model", refuse)


def test_config_validates_on_a_stand_in_checkpoint(tiny_llama, monkeypatch, no_fetching):
    """`titanrl train examples/reasoning/config.py` with $REASONING_CHECKPOINT: validates, trains on
    2,000 chain_sum rows and scores 200 held-out ones (none a training question) under the
    "last_line" convention, rendered with the checkpoint's chat template, with the answer and format
    rewards weighted 1.0 / 0.1 and a correct threshold of 1.0 (format alone is never correct)."""
    monkeypatch.setenv("REASONING_CHECKPOINT", str(tiny_llama))
    with pytest.warns(UserWarning, match="held-out rows whose question is also a training question"):
        config = load_config_file(str(EXAMPLE / "config.py"))
    assert config.rollout.engine.max_model_len == 256  # SmolLM2: ~85 prompt tokens + 64
    config = apply_overrides(config, BYTE_TOKENS)
    validate(config)
    assert config.model.checkpoint == str(tiny_llama)
    assert config.rewards == [reasoning_gym_answer, reasoning_gym_format] and config.reward_weights == [1.0, 0.1]
    assert config.eval.correct_threshold == 1.0 and max(config.reward_weights[1:]) < config.eval.correct_threshold
    assert (config.rollout.prompts_per_step, config.rollout.group_size, config.rollout.sampling.max_new_tokens) == (
        16,
        8,
        64,
    )
    train, held_out = load_run_rows(config)
    assert len(train) == 2000 and len(held_out) == config.eval.max_prompts == 200  # nothing dropped as overlong
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    for row in train[:20] + held_out:
        assert row["task"] == "chain_sum" and row["answer_format"] == "last_line"
        assert row["prompt"].endswith(f"{row['question']}\n\n{LAST_LINE_INSTRUCTION}<|im_end|>\n"
                                      "<|im_start|>assistant\n")
        fields = {k: v for k, v in row.items() if k != "prompt"}
        assert reasoning_gym_answer(row["prompt"], f"Answer: {row['answer']}", **fields) == 1.0


def test_without_a_checkpoint_the_config_gets_smollm2(tiny_llama, monkeypatch, capsys):
    """From a fresh checkout (no $REASONING_CHECKPOINT) the config asks `titanrl models get`'s
    get_model for smollm2-135m-instruct (its cache folder) and trains what it returns, saying so."""
    import titanrl.commands.models as models

    calls = []
    monkeypatch.delenv("REASONING_CHECKPOINT", raising=False)
    monkeypatch.setattr(models, "get_model", lambda name, *rest: calls.append((name, rest)) or tiny_llama)
    monkeypatch.setattr(models, "is_complete", lambda *args: False)
    with pytest.warns(UserWarning):
        config = load_config_file(str(EXAMPLE / "config.py"))
    assert calls == [("smollm2-135m-instruct", ())]  # no folder: the cache
    assert config.model.checkpoint == str(tiny_llama)
    assert "smollm2-135m-instruct is not cached" in capsys.readouterr().err


def test_eval_gsm_scores_its_eval_rows_with_the_reward_weights(tiny_llama, monkeypatch, no_fetching):
    """`titanrl eval CKPT --config examples/reasoning/eval_gsm.py`: 200 held-out gsm_symbolic rows in
    memory (data.eval_rows), a 256-token budget, and one rollout worker built with the config's reward
    weights. A stand-in worker answers half the rows right and half well formed but wrong: accuracy
    0.5 (unweighted, format alone would reach the threshold and give 1.0)."""
    import titanrl.rollout.worker as worker_module
    from titanrl.commands.evaluate import evaluate_checkpoint
    from titanrl.rewards.batch_scoring import RewardScorer, ToScore
    from titanrl.rewards.scoring import eval_summary

    monkeypatch.setenv("REASONING_CHECKPOINT", str(tiny_llama))
    config = load_config_file(str(EXAMPLE / "eval_gsm.py"))
    assert config.data.eval_file == "" and len(config.data.eval_rows) == 200
    assert (
        config.eval.max_new_tokens == 256 and config.rollout.engine.max_model_len >= 256 + 215
    )  # SmolLM2's longest: 215
    config = apply_overrides(config, BYTE_TOKENS)
    built = {}

    class StandInWorker:
        def __init__(self, worker_id, resolved, **kwargs):
            config = resolved.config
            built.update(reward_weights=config.reward_weights, checkpoint=config.model.checkpoint)
            self.scorer = RewardScorer(config.rewards, timeout_s=None, error_value=0.0, weights=config.reward_weights)
            self.prompt_field = config.data.prompt_field

        def evaluate(self, rows, max_new_tokens, correct_threshold):
            built.update(rows=rows, max_new_tokens=max_new_tokens)
            answers = [r["answer"] if i % 2 == 0 else f"{r['answer']}1" for i, r in enumerate(rows)]
            items = [ToScore(r[self.prompt_field], f"Working.\nAnswer: {a}",
                             {k: v for k, v in r.items() if k != self.prompt_field}) for r, a in zip(rows, answers)]
            scored = self.scorer.score(items)
            return eval_summary([s[0] for s in scored], correct_threshold, 0, [s[1] for s in scored])

        def close(self):
            self.scorer.close()

    monkeypatch.setattr(worker_module, "RolloutWorker", StandInWorker)
    report = evaluate_checkpoint(config, tiny_llama)
    assert built["max_new_tokens"] == 256 and len(built["rows"]) == report.prompts == 200
    assert {r["task"] for r in built["rows"]} == {"gsm_symbolic"}
    assert report.accuracy == 0.5 and report.reward_errors == 0
    assert report.reward_mean == pytest.approx((100 * 1.1 + 100 * 0.1) / 200)
    assert built["reward_weights"] == [1.0, 0.1] and built["checkpoint"] == str(tiny_llama)


@pytest.fixture(autouse=True)
def _forget_example_modules():
    """The example's `task` and `config` modules stay out of other tests' imports."""
    yield
    for name in ("task", "config"):
        module = sys.modules.get(name)
        if module is not None and Path(getattr(module, "__file__", "") or "").parent == EXAMPLE:
            del sys.modules[name]
    while str(EXAMPLE) in sys.path:
        sys.path.remove(str(EXAMPLE))
