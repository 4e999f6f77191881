"""GRPO trains the tool agent written as a plain OpenAI-client loop (`agent.py`).

    titanrl train examples/openai_agent/config.py --out runs/openai_agent

The task, data and warm start are examples/tool_agent's; here the episodes are played by
`agent.agent`, which talks to each rollout worker's OpenAI-compatible endpoint and runs its
`python` calls in the worker's sandbox. Needs bubblewrap (`make system-deps`).
"""

from pathlib import Path

import titanrl
from agent import MAX_TOKENS, agent  # the example's agent.py (its folder is on sys.path)

HERE = Path(__file__).resolve().parent
TOOL_AGENT = HERE.parent / "tool_agent"

config = titanrl.RunConfig(
    model=titanrl.ModelConfig(checkpoint=str(TOOL_AGENT / "warm_start")),
    data=titanrl.DataConfig(train_file=str(TOOL_AGENT / "data" / "train.jsonl"),
                            eval_file=str(TOOL_AGENT / "data" / "eval.jsonl")),
    rollout=titanrl.RolloutConfig(
        prompts_per_step=8,
        group_size=8,
        sampling=titanrl.SamplingConfig(temperature=1.0, max_new_tokens=MAX_TOKENS),
        engine=titanrl.EngineConfig(max_model_len=512, max_num_seqs=128),
    ),
    train=titanrl.TrainConfig(
        steps=60,
        optimizer=titanrl.OptimizerConfig(lr=3e-4),  # the tool agent's (1e-3 broke its call format)
        lr_schedule=titanrl.LrScheduleConfig(warmup_steps=5, decay="cosine", min_lr_ratio=0.1),
        max_staleness=1,
        memory=titanrl.MemoryConfig(micro_batch_size=64),
    ),
    eval=titanrl.EvalConfig(every_steps=10),
    agent=titanrl.AgentConfig(fn=agent, chat_template=str(HERE / "chat_template.jinja"), max_calls=3,
                              sandbox_pool_size=4),
    output=titanrl.OutputConfig(rollouts_per_step=2),
)
