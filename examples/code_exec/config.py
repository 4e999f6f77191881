"""Code execution: the model writes a Python function; hidden unit tests in the sandbox score it.

    titanrl train examples/code_exec/config.py --out runs/code_exec                         # tiny model
    titanrl train examples/code_exec/config.py --model.checkpoint=/path/to/hf_checkpoint   # any HF model

Without `--model.checkpoint` a tiny random checkpoint (4,096 positions: the tool prompt is
~1,100 byte-level tokens) is written once to `.tiny_checkpoint/` here; it exercises the whole
loop (episodes, sandbox, rewards, GRPO) but will not learn to code at that size.
"""

from pathlib import Path

import titanrl
from env import make_env  # this example's env.py (its folder is on sys.path)

from titanrl.models.tiny import write_tiny_checkpoint

HERE = Path(__file__).resolve().parent
TINY = HERE / ".tiny_checkpoint"


def make_config() -> titanrl.RunConfig:
    if not (TINY / "config.json").is_file():
        write_tiny_checkpoint(TINY, max_position_embeddings=4096)
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(TINY)),
        data=titanrl.DataConfig(
            train_file=str(HERE / "data" / "train.jsonl"), eval_file=str(HERE / "data" / "eval.jsonl")
        ),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=4,
            group_size=4,
            sampling=titanrl.SamplingConfig(temperature=1.0, max_new_tokens=256),
            engine=titanrl.EngineConfig(max_model_len=4096),
        ),
        train=titanrl.TrainConfig(
            steps=10, optimizer=titanrl.OptimizerConfig(lr=1e-5), memory=titanrl.MemoryConfig(micro_batch_size=4)
        ),
        # Correct means every hidden test passes.
        eval=titanrl.EvalConfig(every_steps=5, correct_threshold=1.0),
        env=titanrl.EnvConfig(factory=make_env, max_turns=3, max_total_tokens=1024, sandbox_pool_size=4),
        output=titanrl.OutputConfig(rollouts_per_step=4),
    )
