"""GRPO on math word problems in GSM8K's format, scored by math-verify answer equivalence.

    python examples/math/make_data.py                  # the sample data (already in data/)
    titanrl train examples/math/config.py --out runs/math

The question is one user message under the checkpoint's chat template (data.messages_field),
after a system prompt asking for GSM8K's `#### N` answer line; the reward is
`titanrl.rewards.math_answer`. As shipped it runs a random tiny Qwen3 (written to tiny/ on first
use) on the generated sample; the real dataset and a real model are overrides:

    titanrl train examples/math/config.py --out runs/gsm8k \\
        --model.checkpoint=/models/Qwen3-0.6B \\
        --data.train_file='/data/gsm8k/main/train-*.parquet' \\
        --data.eval_file='/data/gsm8k/main/test-*.parquet' \\
        --rollout.engine.max_model_len=1536 --rollout.sampling.max_new_tokens=512
"""

import titanrl
from task import HERE, SYSTEM_PROMPT, tiny_checkpoint  # the example's own task.py (its folder is on sys.path)
from titanrl.rewards import math_answer


def make_config() -> titanrl.RunConfig:
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(tiny_checkpoint())),
        data=titanrl.DataConfig(
            train_file=str(HERE / "data" / "train.jsonl"),
            eval_file=str(HERE / "data" / "eval.jsonl"),
            messages_field="question",
            system_prompt=SYSTEM_PROMPT,
        ),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=8,
            group_size=4,
            sampling=titanrl.SamplingConfig(max_new_tokens=96),
            engine=titanrl.EngineConfig(max_model_len=512),
        ),
        train=titanrl.TrainConfig(
            steps=20, optimizer=titanrl.OptimizerConfig(lr=1e-5), lr_schedule=titanrl.LrScheduleConfig(warmup_steps=2)
        ),
        eval=titanrl.EvalConfig(every_steps=10, max_prompts=64),
        rewards=[math_answer],
    )
