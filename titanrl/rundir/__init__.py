"""The run directory: its layout and config record (`layout`), atomic training checkpoints
(`checkpoints`), metrics.jsonl / TensorBoard / plots (`metrics`) and rollouts.jsonl rows
(`rollout_log`)."""
