"""The reasoning example's pieces, shared by config.py (training) and eval_gsm.py (transfer eval).

- `model_checkpoint()`: SmolLM2-135M-Instruct as an HF checkpoint, from `titanrl models get`
  (converted into the cache on first use), or the folder `$REASONING_CHECKPOINT` names;
- `chain_sum_data()`: the training task, reasoning-gym chain_sum with two terms of 1-2 digits,
  asking for a final `Answer: N` line;
- `gsm_symbolic_data()`: reasoning-gym gsm_symbolic word problems under the same convention, for
  the held-out transfer check.
"""

from __future__ import annotations

from titanrl.data_sources.reasoning_gym import reasoning_gym_data

MODEL = "smollm2-135m-instruct"
"""The `titanrl models get` name of the policy."""
CHECKPOINT_ENV = "REASONING_CHECKPOINT"
"""An HF checkpoint folder to use instead of fetching MODEL (nothing is installed or converted)."""
ANSWER_FORMAT = "last_line"
"""The answer convention: the prompt asks for a final line `Answer: <answer>` and both rewards
read that line. SmolLM2-135M-Instruct ignores reasoning-gym's own `<answer>` tags (0 of 8 in a
first measurement), so under them every reward would be 0 and GRPO would have nothing to learn
from; it writes `Answer: N` lines in some samples (see README.md)."""

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
"""Easy chain_sum: `a + b` or `a - b` with a and b of one or two digits (reasoning-gym's
ChainSumConfig; each question draws its digit count, 1 or 2, then both numbers: 0-9 or 10-99).
Only 200 one-digit questions exist, so 2,000 training rows hold nearly all of them and the
held-out rows that repeat a training question are dropped: what is held out is almost only
two-digit questions (16,200 of those exist)."""
TRAIN_SIZE = 2000
EVAL_SIZE = 400
"""Held-out entries generated; ~half repeat a training question (the one-digit ones) and are
dropped, leaving 205, of which eval.max_prompts=200 are scored."""
SEED = 0


def model_checkpoint() -> str:
    """The policy's HF checkpoint folder: `$REASONING_CHECKPOINT` when set, else MODEL converted
    into the cache on first use (`titanrl models get`)."""
    from titanrl.commands.models import example_checkpoint

    return example_checkpoint(MODEL, CHECKPOINT_ENV)


def chain_sum_data():
    """The training and held-out rows (a titanrl.DataConfig): chain_sum under CHAIN_SUM, as chat
    messages rendered with the checkpoint's chat template (SmolLM2's ChatML, its default system
    prompt included)."""
    return reasoning_gym_data("chain_sum", CHAIN_SUM, seed=SEED, train_size=TRAIN_SIZE, eval_size=EVAL_SIZE,
                              answer_format=ANSWER_FORMAT)


def gsm_symbolic_data(eval_size: int = 200):
    """gsm_symbolic word problems (reasoning-gym's default config), `eval_size` held-out rows
    under the same answer convention; the one training row is never used (`titanrl eval` scores
    the held-out rows only)."""
    return reasoning_gym_data("gsm_symbolic", seed=SEED, train_size=1, eval_size=eval_size,
                              answer_format=ANSWER_FORMAT)
