"""GRPO teaches a small model to use a Python tool: call it, read the result, answer.

    titanrl train examples/tool_agent/config.py --out runs/tool_agent

Starts from `warm_start/` (made by `make_warm_start.py`), which usually answers from its
head and is therefore usually wrong; every episode's tool calls run for real in the
bubblewrap sandbox. `eval/accuracy` in metrics.jsonl is greedy held-out episode success;
`env/tool_calls` and `env/errors` show the behaviour changing. Needs bubblewrap
(`make system-deps`).
"""

from pathlib import Path

import titanrl
from env import make_env  # the example's env.py (its folder is on sys.path)
from task import MAX_TOKENS_PER_TURN, MODEL_CONFIG

HERE = Path(__file__).resolve().parent

config = titanrl.RunConfig(
    model=titanrl.ModelConfig(checkpoint=str(HERE / "warm_start")),
    data=titanrl.DataConfig(train_file=str(HERE / "data" / "train.jsonl"), eval_file=str(HERE / "data" / "eval.jsonl")),
    rollout=titanrl.RolloutConfig(
        prompts_per_step=8,
        group_size=8,
        sampling=titanrl.SamplingConfig(temperature=1.0, max_new_tokens=MAX_TOKENS_PER_TURN),
        engine=titanrl.EngineConfig(max_model_len=MODEL_CONFIG["max_position_embeddings"], max_num_seqs=128),
    ),
    train=titanrl.TrainConfig(
        steps=100,
        # 1e-3 (the arithmetic demo's) broke the call format within 8 steps at 64 episodes a step.
        optimizer=titanrl.OptimizerConfig(lr=3e-4),
        lr_schedule=titanrl.LrScheduleConfig(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
        # Generate the next batch while training on this one: both CPU cores stay busy.
        max_staleness=1,
        memory=titanrl.MemoryConfig(micro_batch_size=64),
    ),
    eval=titanrl.EvalConfig(every_steps=10),
    env=titanrl.EnvConfig(factory=make_env, max_turns=3, max_total_tokens=256, sandbox_pool_size=4),
    output=titanrl.OutputConfig(rollouts_per_step=2),
)
