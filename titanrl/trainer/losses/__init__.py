"""Policy losses of the GRPO step: variants (settings, policy), aggregation, off-policy correction.

`GRPOStep._loss` composes them per micro-batch; the modules import nothing of the step.
"""
