"""GRPO on a real pretrained model: SmolLM2-135M-Instruct learns reasoning-gym's chain_sum.

    titanrl train examples/reasoning/config.py --out runs/reasoning
    make reasoning                                  # the same, after set-up

The model is fetched on first use (`titanrl models get smollm2-135m-instruct`, into
~/.cache/titanrl/models/; see task.py); `REASONING_CHECKPOINT=DIR` uses a checkpoint folder you
already have instead. Prompts are the question plus an instruction to end with a line
`Answer: <answer>`, under SmolLM2's chat template; rewards are the task's own checker on that
line (1 or 0) and a format term (weight 0.1). `eval/accuracy` in metrics.jsonl is held-out greedy
accuracy: the fraction of held-out questions whose greedy completion's weighted reward reaches
eval.correct_threshold (1.0), i.e. whose `Answer:` line is right (format alone gives 0.1).
Transfer to word problems: eval_gsm.py. Sized for ~30 minutes on a 2-core CPU (README.md).
"""

import titanrl
from task import chain_sum_data, model_checkpoint  # the example's own task.py (its folder is on sys.path)
from titanrl.rewards.reasoning_gym import reasoning_gym_answer, reasoning_gym_format

MAX_NEW_TOKENS = 64
"""Completion budget. `a + b = c` then `Answer: c` is ~15 tokens; 64 leaves room for a line of
working and truncates rambling samples (which then have no answer line and score 0, a pressure
towards short answers). Generation and training cost grow with it."""


def make_config(data: titanrl.DataConfig | None = None) -> titanrl.RunConfig:
    """The run's config; `data` replaces the chain_sum rows (eval_gsm.py's word problems)."""
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=model_checkpoint()),
        data=data if data is not None else chain_sum_data(),
        rollout=titanrl.RolloutConfig(
            # 16 prompts x 8 samples = 128 completions per step (~85 prompt + <= 64 new tokens each).
            # Measured 2026-12-06 (README.md): 24-26 s a step once completions shrink to ~6 tokens
            # (27-38 s with vLLM's default KV block), so 45 steps and 4 evaluations take under 30
            # minutes; 8 prompts a step (15 steps) reached only 6.5 %. Groups of 8 give GRPO a usable contrast when only a few samples are right.
            prompts_per_step=16,
            group_size=8,
            # Full-softmax sampling: exploration is what finds the `Answer:` line at first.
            sampling=titanrl.SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS),
            # max_model_len: the prompt (~85 tokens with SmolLM2's default system prompt) + 64.
            # kv_cache_gib: 46 KB of KV per token, ~45k tokens: all 200 eval prompts at once.
            engine=titanrl.EngineConfig(max_model_len=256, kv_cache_gib=2.0),
        ),
        train=titanrl.TrainConfig(
            steps=45,
            # Full fine-tuning of 135M parameters with Adam on 128 completions a step: at 3e-5 the format
            # is learned in ~10 steps and the answers from step ~15 on (measured); much higher risks
            # collapse on batches this small. Two warm-up steps, then constant (no time to decay).
            optimizer=titanrl.OptimizerConfig(lr=3e-5),
            lr_schedule=titanrl.LrScheduleConfig(warmup_steps=2, decay="constant"),
            # Generate the next batch while training on this one (both cores busy); the PPO clip
            # bounds the one-step-stale update. 0 (on-policy) is the fallback if it is unstable (slower:
            # generation and training then take turns).
            max_staleness=1,
            # 16 sequences per forward/backward keeps activation memory ~2 GB (64 would be ~7 GB).
            memory=titanrl.MemoryConfig(micro_batch_size=16),
            # The trainer takes both cores while the rollout worker waits for new weights.
            compute=titanrl.ComputeConfig(threads=1, threads_when_rollouts_idle=2),
        ),
        # Before step 1 and every 15 steps (15, 30, 45 = the last): 4 evaluations of 200 held-out
        # questions, greedy (~70 s each).
        eval=titanrl.EvalConfig(every_steps=15, max_prompts=200),
        rewards=[reasoning_gym_answer, reasoning_gym_format],
        # With correct_threshold 1.0, a completion counts as correct exactly when the answer reward is 1:
        # a right answer scores 1.0 (1.1 well formed), a well-formed wrong one 0.1.
        reward_weights=[1.0, 0.1],
        scoring=titanrl.ScoringConfig(
            health=titanrl.RewardHealthConfig(agreement_pairs=["reasoning_gym_format:reasoning_gym_answer"])),
    )
