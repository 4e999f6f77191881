"""The trainer on torch_xla: what runs inside the XLA trainer process.

`GRPOTrainer` with `train.compute.device='xla'` keeps its one loss path (`GRPOStep`, which pads
batches to `titanrl.trainer.shape_buckets` there so a run compiles a bounded number of
programs); this package adds what XLA needs around it: the runtime and its SPMD mesh
(runtime.py), the optimizer update without a host round trip (update.py), and CPU copies for the
checkpoint formats (checkpoint.py). runtime.py needs torch_xla (its own venv, torch 2.9); nothing
outside this package imports torch_xla.
"""
