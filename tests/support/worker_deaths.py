"""Rewards that kill their own rollout worker (or the trainer) at a chosen call, and the checks
around them: the worker-death tests of both rollout modes share them.

The reward runs inside the rollout worker's process, so `os.kill(os.getpid(), SIGKILL)` there is
a worker dying mid-generation, exactly as an out-of-memory kill would. Call counts are kept in
files (workers are separate processes); this module is shipped to the workers by value with the
reward, so the globals `arm` sets travel with it.
"""

from __future__ import annotations

import fcntl
import os
import signal
from pathlib import Path

import titanrl

COUNTER_DIR = ""
"""Set by each test before its run; shipped to the workers with the reward function (by value)."""
KILL_AT = 0
"""The reward call that kills its worker (1-based)."""
KILL_EVERY_LATER_CALL = False
"""Also kill at every call after KILL_AT (a worker that keeps dying)."""


def count_call() -> int:
    with open(Path(COUNTER_DIR) / "calls", "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(b"x")
        f.flush()
        return f.tell()


def killing_reward(prompt: str, completion: str, **fields) -> float:
    """Digit share of the completion; kills its own worker process at call KILL_AT (and later ones)."""
    n = count_call()
    if n == KILL_AT or (KILL_EVERY_LATER_CALL and n > KILL_AT):
        os.kill(os.getpid(), signal.SIGKILL)
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def actor_pids(*class_names: str) -> list[int]:
    """Processes whose title says they run an actor of one of `class_names` (Ray sets `ray::Class...`)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            continue
        if any(title.startswith(f"ray::{name}") for name in class_names):
            pids.append(int(proc.name))
    return pids


def trainer_killing_reward(prompt: str, completion: str, **fields) -> float:
    """Digit share; at call KILL_AT it kills the trainer actor's process instead."""
    if count_call() == KILL_AT:
        for pid in actor_pids("GRPOTrainer"):
            os.kill(pid, signal.SIGKILL)
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def run_config(tmp_path: Path, tiny_run, reward, threads_when_rollouts_idle: int | None = None,
            **rollout) -> titanrl.RunConfig:
    return titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
        data=titanrl.DataConfig(train_file=str(tiny_run.train_file), eval_file=str(tiny_run.eval_file(8))),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=4,
            group_size=4,
            sampling=titanrl.SamplingConfig(max_new_tokens=8),
            engine=titanrl.EngineConfig(max_model_len=64),
            continuous=True,
            **rollout,
        ),
        train=titanrl.TrainConfig(
            steps=4,
            optimizer=titanrl.OptimizerConfig(lr=3e-3),
            max_staleness=1,
            compute=titanrl.ComputeConfig(threads_when_rollouts_idle=threads_when_rollouts_idle),
        ),
        eval=titanrl.EvalConfig(every_steps=2, correct_threshold=0.5),
        output=titanrl.OutputConfig(
            dir=str(tmp_path / "run"), progress_bar=False, rollouts_per_step=4, save_every_steps=1
        ),
        rewards=[reward],
    )


def arm(tmp_path: Path, kill_at: int, every_later_call: bool = False) -> None:
    global COUNTER_DIR, KILL_AT, KILL_EVERY_LATER_CALL
    COUNTER_DIR, KILL_AT, KILL_EVERY_LATER_CALL = str(tmp_path), kill_at, every_later_call


def alive_run_actors() -> list[int]:
    """Processes of this run's actors still alive (killed actors' processes exit within moments)."""
    import time

    deadline = time.monotonic() + 30
    while (pids := actor_pids("GRPOTrainer", "TrainerGroup", "RolloutWorker", "ContinuousRolloutWorker")) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    return pids


def shm_names() -> set[str]:
    """TitanRL's weight segments and busy-flag files in /dev/shm (other processes' entries, e.g.
    multiprocessing semaphores of a concurrent job, are not this run's to clean up)."""
    from titanrl.busy_flags import FILE_PREFIX
    from titanrl.weight_sync.segment import PREFIX

    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith((PREFIX, FILE_PREFIX))}


async def killing_agent(base_url: str, api_key: str, row: dict) -> float:
    """An OpenAI-client agent (one chat call; reward: the digit share of the reply) that kills its
    own worker process at episode KILL_AT (and later ones): a worker dying mid-episode."""
    import openai

    n = count_call()
    if n == KILL_AT or (KILL_EVERY_LATER_CALL and n > KILL_AT):
        os.kill(os.getpid(), signal.SIGKILL)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                                 max_tokens=8)
    text = reply.choices[0].message.content or ""
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)
