"""Synchronous vs asynchronous GRPO on a workload with environment latency, in one script.

The same job (model, data, seed, steps, 2 rollout workers) runs three times:
  sync            lock-step rollouts, train.max_staleness=0 (today's on-policy default);
  async           rollout.continuous=True, train.max_staleness=2 (groups of the next two steps
                  generate while the trainer works, new weights land between engine steps);
  lockstep_stale  lock-step rollouts with the same train.max_staleness=2 (each worker call still
                  waits for its whole batch, slowest episode included): what continuous
                  generation itself buys at equal staleness.
Every episode calls a tool that waits a random 50-300 ms before answering (a remote sandbox
or grader), `--turns` times. Prints one JSON line per run and a summary line:
  {"sync_s": ..., "async_s": ..., "speedup": ..., "lockstep_stale_s": ...,
   "continuous_over_lockstep_same_staleness": ..., "sync_final_reward": ..., ...}
(`speedup` and `continuous_over_lockstep_same_staleness` are the other run's time over async's:
> 1, continuous is faster.)
Times are the training loop's wall time (first step to last, the final evaluation included),
without actor start-up. Rewards: `final_eval_reward` is the final policy's greedy reward on 32
held-out prompts (the fair comparison: at equal steps, an asynchronous run's last training
samples come from an older policy than a synchronous run's); `final_train_reward` is the mean
`reward/mean` of the last 5 steps. Both runs use train.off_policy.decoupled_loss.

    python benchmarks/async_speedup.py [--steps 20] [--turns 3]
    python benchmarks/async_speedup.py --smoke     # sync and async only, 2 steps, 1 turn, 1 worker: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import titanrl
from titanrl.data import write_rows
from titanrl.envs import EnvContext, Environment, StepResult
from titanrl.models.tiny import write_tiny_checkpoint

TURNS = 3
"""Tool calls per episode (set from --turns before the runs start; shipped to workers by value)."""


class SlowToolEnv(Environment):
    """Each model turn is sent to a 'tool' that answers after 50-300 ms; the last turn is scored.

    The reward is the share of digits in the final turn, which a tiny random model can learn to
    raise within a few dozen steps.
    """

    def __init__(self, context: EnvContext) -> None:
        self.turn = 0
        self.rng = random.Random()

    async def reset(self, row: dict[str, Any]) -> str:
        return row["prompt"]

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        await asyncio.sleep(self.rng.uniform(0.05, 0.3))
        if self.turn >= TURNS:
            return StepResult("", reward=sum(c.isdigit() for c in action) / max(len(action), 1), done=True,
                              info={"tool_calls": 1})
        return StepResult(" ok:", info={"tool_calls": 1})


def make_env(context: EnvContext) -> SlowToolEnv:
    return SlowToolEnv(context)


def run_config(root: Path, name: str, steps: int, continuous: bool, max_staleness: int,
               workers: int = 2) -> titanrl.RunConfig:
    ckpt = root / "ckpt"
    if not ckpt.exists():
        write_tiny_checkpoint(ckpt, seed=5, std=0.1)
        write_rows(root / "train.jsonl", [{"prompt": f"{i}+{i % 7}="} for i in range(64)])
        write_rows(root / "eval.jsonl", [{"prompt": f"{i}*{i % 5}="} for i in range(32)])
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(ckpt)),
        data=titanrl.DataConfig(train_file=str(root / "train.jsonl"), eval_file=str(root / "eval.jsonl")),
        rollout=titanrl.RolloutConfig(
            num_workers=workers,
            prompts_per_step=8,
            group_size=4,
            sampling=titanrl.SamplingConfig(max_new_tokens=8),
            engine=titanrl.EngineConfig(max_model_len=128),
            continuous=continuous,
        ),
        train=titanrl.TrainConfig(
            steps=steps,
            optimizer=titanrl.OptimizerConfig(lr=3e-3),
            max_staleness=max_staleness,
            off_policy=titanrl.OffPolicyConfig(decoupled_loss=True),
        ),
        eval=titanrl.EvalConfig(every_steps=steps),  # step 0 (before the loop) and the final policy
        env=titanrl.EnvConfig(factory=make_env, max_turns=TURNS, max_total_tokens=96, sandbox_pool_size=0),
        output=titanrl.OutputConfig(dir=str(root / name), progress_bar=False, rollouts_per_step=1),
        seed=0,
    )


def measure(config: titanrl.RunConfig) -> dict[str, float]:
    rows = [m for m in titanrl.train(config).metrics if m["step"] > 0]
    loop_start = rows[0]["time/elapsed_s"] - rows[0]["time/step_s"]
    last = rows[-5:]
    return {
        "loop_s": rows[-1]["time/elapsed_s"] - loop_start,
        "final_eval_reward": rows[-1]["eval/reward_mean"],
        "final_train_reward": sum(m["reward/mean"] for m in last) / len(last),
        "first_reward": rows[0]["reward/mean"],
        "trainer_idle_s": sum(m.get("time/trainer_idle_s", m["time/wait_rollout_s"]) for m in rows),
        "staleness_max": max(m["staleness/max"] for m in rows),
    }


def main() -> None:
    global TURNS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="rollout workers of every run")
    parser.add_argument("--smoke", action="store_true",
                        help="a check that the script runs: --steps 2 --turns 1 --workers 1, and not the "
                             "lockstep_stale run (each run starts its actors, ~20 s; the sync run's path with "
                             "another max_staleness); numbers mean nothing")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.turns, args.workers = 2, 1, 1
    TURNS = args.turns
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sync = measure(run_config(root, "sync", args.steps, continuous=False, max_staleness=0, workers=args.workers))
        print(json.dumps({"run": "sync", **sync}), flush=True)
        async_ = measure(run_config(root, "async", args.steps, continuous=True, max_staleness=2, workers=args.workers))
        print(json.dumps({"run": "async", **async_}), flush=True)
        stale = None if args.smoke else measure(run_config(root, "lockstep_stale", args.steps, continuous=False,
                                                           max_staleness=2, workers=args.workers))
        if stale is not None:
            print(json.dumps({"run": "lockstep_stale", **stale}), flush=True)

    def of_stale(value):  # the lockstep_stale run's numbers; None where --smoke left it out
        return None if stale is None else value(stale)

    print(json.dumps({
        "benchmark": "async_speedup", "smoke": args.smoke, "steps": args.steps, "turns": args.turns,
        "workers": args.workers,
        "sync_s": round(sync["loop_s"], 2), "async_s": round(async_["loop_s"], 2),
        "speedup": round(sync["loop_s"] / async_["loop_s"], 2),
        "lockstep_stale_s": of_stale(lambda r: round(r["loop_s"], 2)),
        "continuous_over_lockstep_same_staleness": of_stale(lambda r: round(r["loop_s"] / async_["loop_s"], 2)),
        "sync_final_reward": round(sync["final_eval_reward"], 4), "async_final_reward": round(async_["final_eval_reward"], 4),
        "sync_final_train_reward": round(sync["final_train_reward"], 4),
        "async_final_train_reward": round(async_["final_train_reward"], 4),
        "lockstep_stale_final_reward": of_stale(lambda r: round(r["final_eval_reward"], 4)),
    }))


if __name__ == "__main__":
    main()
