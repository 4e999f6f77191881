"""The run directory: its layout and config record (`layout`), atomic training checkpoints
(`checkpoints`), metrics.jsonl / TensorBoard (`metrics`) with its W&B mirror (`wandb_mirror`),
progress.png (`progress`) and rollouts.jsonl rows (`rollout_log`)."""
