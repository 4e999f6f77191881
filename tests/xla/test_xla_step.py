"""The GRPO step on XLA: the CPU trainer's numbers, one compiled program per shape bucket, and
the device-side skip of a non-finite update."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from groups import make_groups
from helpers import host_grads, host_weights, max_diff, trainer

GROUPS = [[5, 7, 3], [6, 2]]
"""Five rows, at most 11 tokens: the (8 rows, 16 tokens) bucket."""


@pytest.fixture(scope="module")
def xla_trainer(tiny_ckpt):
    return trainer(tiny_ckpt, "xla")


def test_first_step_gradients_and_loss_match_the_cpu_trainer(tiny_ckpt, xla_trainer):
    """Same torch process, same checkpoint and groups: the XLA trainer's gradients, first-step
    loss, grad norm and updated weights equal the CPU trainer's to 1e-5 (the base of the
    end-to-end 1e-4 check), with the policy, its AdamW moments and the tied head on the device."""
    cpu = trainer(tiny_ckpt, "cpu")
    groups = make_groups(GROUPS)
    batch = cpu.prepare_batch(groups)
    cpu_stats, xla_stats = cpu.accumulate_gradients(batch), xla_trainer.accumulate_gradients(batch)
    assert xla_stats.loss_sum == pytest.approx(cpu_stats.loss_sum, abs=1e-5)
    assert max_diff(host_grads(xla_trainer), host_grads(cpu)) <= 1e-5
    cpu_m, xla_m = cpu.step(groups), xla_trainer.step(groups)
    assert abs(xla_m["loss"] - cpu_m["loss"]) <= 1e-5
    assert xla_m["grad_norm"] == pytest.approx(cpu_m["grad_norm"], rel=1e-5)
    assert xla_m["train/entropy"] == pytest.approx(cpu_m["train/entropy"], rel=1e-5)
    assert xla_m["parity/tokens_checked"] == cpu_m["parity/tokens_checked"]
    assert max_diff(host_weights(xla_trainer), host_weights(cpu)) <= 1e-5
    model = xla_trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied on the device too
    assert all(p.device.type == "xla" for p in model.parameters())
    assert all(v.device.type == "xla" for s in xla_trainer.optimizer.state.values() for k, v in s.items()
               if k != "step")


# Run in a fresh process: XLA's compile cache is per process, so an earlier test's trainer here
# may already hold a graph; alone, every bucket's program must be compiled exactly once.
COMPILE_COUNTS = """
import json, math, os, sys
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")
import torch_xla.runtime as xr
xr.use_spmd()
xr.global_runtime_device_count()
from groups import make_groups
from helpers import trainer
xla_trainer = trainer(sys.argv[1], "xla")
xla_trainer.step(make_groups([[5, 7, 3], [6, 2]], seed=9))  # the first step, in neither bucket below
warmup = [[[5, 7, 3], [6, 2]], [[20, 3, 9], [1, 17]]]  # buckets (8, 16) and (8, 32)
later = [[[2, 11], [4, 8, 1]], [[25, 2], [3, 3, 18]], [[9, 9, 9], [1, 2]], [[12], [13, 14, 2, 3]]]
before = xla_trainer.xla.compile_metrics()["xla/compiles"]
for i, lengths in enumerate(warmup):
    m = xla_trainer.step(make_groups(lengths, seed=10 + i))
out = {"before": before, "warm": m["xla/compiles"], "compile_s": m["xla/compile_s"], "buckets": len(warmup), "later": []}
for i, lengths in enumerate(later):
    m = xla_trainer.step(make_groups(lengths, seed=20 + i))
    out["later"].append([m["xla/compiles"], math.isfinite(m["loss"]), m["train/optimizer_steps"]])
print(json.dumps(out))
"""


def test_steps_over_varied_lengths_compile_once_per_bucket(tiny_ckpt):
    """After the trainer's first step (its graph differs from every later one's, so it is its own
    program), steps whose lengths and row counts vary within two buckets compile exactly one
    program per bucket (the whole step: forward, loss, backward, clip, AdamW), then nothing new;
    the metrics report the count and the compile time. In a process of its own (a fresh compile cache)."""
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", COMPILE_COUNTS, str(tiny_ckpt)], cwd=here, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(here), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["warm"] - out["before"] == out["buckets"], out
    assert out["compile_s"] > 0
    for i, (compiles, finite, optimizer_steps) in enumerate(out["later"]):
        assert finite and optimizer_steps == 1.0, out
        assert compiles == out["warm"], f"later step {i} compiled a new program: {out}"


def test_non_finite_loss_skips_the_update_on_the_device(xla_trainer):
    """A NaN generator logprob makes the loss non-finite: the step is skipped as on CPU, and the
    traced update left weights and AdamW moments bit for bit unchanged (no new program)."""
    groups = make_groups(GROUPS, seed=30)
    groups[0].samples[0].gen_logprobs[0] = float("nan")
    compiles = xla_trainer.step(make_groups(GROUPS, seed=31))["xla/compiles"]
    weights = host_weights(xla_trainer)
    moments = {id(p): {k: v.cpu().clone() for k, v in s.items()} for p, s in xla_trainer.optimizer.state.items()}
    m = xla_trainer.step(groups)
    assert m["train/skipped"] == 1.0 and not math.isfinite(m["loss"])
    assert m["xla/compiles"] == compiles
    after = host_weights(xla_trainer)
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    for p, s in xla_trainer.optimizer.state.items():
        assert all(torch.equal(v.cpu(), moments[id(p)][k]) for k, v in s.items())
