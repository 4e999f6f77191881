"""The GRPO loop: take the oldest finished request, train on it, push the weights, queue the next.

`1 + train.max_staleness` requests stay queued. Each step trains on the oldest one, queues
the new weights to every worker behind the requests already there (Ray runs an actor's
calls in order, so a request never mixes two policy versions), then queues the next
request. With `max_staleness=0` this is synchronous on-policy GRPO; with 1, generating the
next batch overlaps training on the current one.

Everything the loop needs to continue exactly is in a checkpoint (`save`): the trainer's
model, optimizer, scheduler and RNG; the data-stream position; the request counters; and
the finished rollouts of older policies that no step has trained on yet.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from titanrl.config import RunConfig
from titanrl.data import PromptStream
from titanrl.errors import RunStopped
from titanrl.metrics import MetricsLogger
from titanrl.rollout_requests import RequestQueue
from titanrl.run_checkpoints import RunCheckpoint, checkpoint_path, writing_checkpoint
from titanrl.summaries import rollout_rows, summarize_groups
from titanrl.types import Group, RolloutBatch

DRIVER_STATE = "driver.pt"
TRAINER_STATE = "trainer"


def say(message: str) -> None:
    print(f"[titanrl] {message}", file=sys.stderr, flush=True)


class GRPOLoop:
    """Drives one run's trainer and rollout workers (Ray actor handles) step by step."""

    def __init__(
        self,
        config: RunConfig,
        trainer: Any,
        workers: list[Any],
        logger: MetricsLogger,
        run_dir: Path,
        train_rows: list[dict[str, Any]],
        eval_rows: list[dict[str, Any]],
        started: float,
    ) -> None:
        self.config, self.trainer, self.workers, self.logger = config, trainer, workers, logger
        self.run_dir, self.eval_rows, self.started = run_dir, eval_rows, started
        rc = config.rollout
        stream = PromptStream(train_rows, rc.prompts_per_step, config.data.shuffle_seed + config.seed)
        turns = config.env.max_turns if config.env.factory is not None else 1
        self.queue = RequestQueue(workers, stream, config.seed, rc.group_size, turns)
        self.step = 0
        """Last completed training step."""
        self.version = 0
        """Trainer's policy version after `step` (skipped steps do not advance it)."""
        self.saved_steps: set[int] = set()

    # ------------------------------------------------------------------ resume

    def restore(self, checkpoint: RunCheckpoint) -> None:
        """Continues from a checkpoint: trainer state, queue, RNG, and the workers' weights."""
        import ray

        state = torch.load(checkpoint.path / DRIVER_STATE, weights_only=False)
        version = ray.get(self.trainer.load_state.remote(str(checkpoint.path / TRAINER_STATE)))
        if version != state["policy_version"]:
            raise RuntimeError(f"{checkpoint.path}: trainer state has version {version}, driver state {state['policy_version']}")
        self.step, self.version = state["step"], version
        self.queue.restore(state["queue"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        weights = self.trainer.state_dict_for_push.remote()
        ray.get([w.update_weights.remote(weights, version) for w in self.workers])
        self.saved_steps.add(self.step)
        exact = "" if state["queue"].exact else " (inexact: some rollouts were lost and are regenerated)"
        say(f"resumed from {checkpoint.path} at step {self.step}, policy version {version}{exact}")

    # ------------------------------------------------------------------ checkpoints

    def save(self, reason: str, wait_s: float | None = None, drop_first: bool = False) -> Path:
        """Writes `checkpoints/step_N/` of the last completed step, atomically."""
        import ray

        queue_state = self.queue.checkpoint(self.version, wait_s=wait_s, drop_first=drop_first)
        driver_state = {
            "step": self.step,
            "policy_version": self.version,
            "queue": queue_state,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        }
        manifest = {"policy_version": self.version, "exact": queue_state.exact, "reason": reason,
                    "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with writing_checkpoint(self.run_dir, self.step, manifest) as tmp:
            ray.get(self.trainer.save_state.remote(str(tmp / TRAINER_STATE)))
            torch.save(driver_state, tmp / DRIVER_STATE)
        self.saved_steps.add(self.step)
        return checkpoint_path(self.run_dir, self.step)

    def save_after_failure(self, reason: str) -> Path | None:
        """Best-effort checkpoint after an exception or Ctrl-C; None (and a message) if impossible."""
        import ray

        try:
            # A step the trainer finished but the loop never recorded (interrupted while waiting).
            actual = ray.get(self.trainer.get_version.remote(), timeout=600)
            if actual > self.version and len(self.queue):
                self.queue.pop()
                self.step, self.version = self.step + 1, actual
            if self.step == 0:
                return None  # nothing was trained yet: the initial checkpoint is the starting point
            if self.step in self.saved_steps:
                return checkpoint_path(self.run_dir, self.step)
            return self.save(reason, wait_s=30)
        except BaseException as e:  # the trainer itself may be what died
            say(f"could not save a checkpoint after the failure ({type(e).__name__}: {e})")
            return None

    # ------------------------------------------------------------------ the loop

    def run(self) -> Path:
        """Runs the remaining steps; returns the final HF checkpoint directory."""
        import ray
        from tqdm import tqdm

        config, tc = self.config, self.config.train
        if self.step == 0:
            initial_eval = self.evaluate(0)
            if initial_eval:
                self.logger.log({"step": 0, **initial_eval, "time/elapsed_s": time.perf_counter() - self.started})
        bar = tqdm(total=tc.steps, initial=self.step, desc="GRPO", unit="step",
                   disable=not config.output.progress_bar, dynamic_ncols=True)
        self._fill_queue()
        for step in range(self.step + 1, tc.steps + 1):
            record = self._one_step(step)
            postfix = {"reward": f"{record['reward/mean']:.2f}", "loss": f"{record['loss']:.3f}"}
            if "eval/accuracy" in record:
                postfix["eval_acc"] = f"{record['eval/accuracy']:.2f}"
            bar.set_postfix(postfix)
            bar.update(1)
            every = config.output.save_every_steps
            if every and step % every == 0 and step != tc.steps:
                self.save("periodic")
        bar.close()
        return Path(ray.get(self.trainer.save.remote(str(self.run_dir / "final"))))

    def _fill_queue(self) -> None:
        tc = self.config.train
        while len(self.queue) < 1 + tc.max_staleness and self.queue.next_index < tc.steps:
            self.queue.submit(self.version)

    def _one_step(self, step: int) -> dict[str, Any]:
        import ray

        config, tc = self.config, self.config.train
        t0 = time.perf_counter()
        request, batches = self.queue.peek()
        t_wait = time.perf_counter() - t0
        groups = [g for b in batches for g in b.groups]
        self._stop_if_rewards_broken(step, groups)
        staleness = [self.version - g.policy_version for g in groups]
        if max(staleness) > tc.max_staleness:  # the loop's invariant; never train on older data
            raise RuntimeError(f"rollout staleness {max(staleness)} exceeds train.max_staleness={tc.max_staleness}")
        train_metrics = ray.get(self.trainer.step.remote(groups))
        self.queue.pop()
        self.step, self.version = step, int(train_metrics["policy_version"])
        skipped = bool(train_metrics.get("train/skipped", 0.0))
        push_refs = []
        if not skipped:  # a refused step changed nothing, so there is nothing to push
            weights = self.trainer.state_dict_for_push.remote()
            push_refs = [w.update_weights.remote(weights, self.version) for w in self.workers]
        self._fill_queue()
        record = self._record(step, groups, batches, train_metrics, staleness, t0, t_wait, push_refs)
        self.logger.log(record)
        self.logger.log_rollouts(step, rollout_rows(groups, config.output.rollouts_per_step))
        if skipped and train_metrics.get("train/consecutive_skipped", 0) >= tc.max_skipped_steps:
            where = self.save("non-finite training")
            raise RunStopped(
                f"{int(train_metrics['train/consecutive_skipped'])} steps in a row had a non-finite loss or gradient "
                f"norm (loss {train_metrics.get('loss')}, grad_norm {train_metrics.get('grad_norm')}) and were skipped; "
                f"the last good policy (version {self.version}) is saved in {where}. Lower train.lr, check the "
                "rewards, or raise train.max_skipped_steps"
            )
        return record

    def _stop_if_rewards_broken(self, step: int, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples]
        broken = [s for s in samples if s.reward_error]
        limit = self.config.max_reward_error_frac
        if broken and len(broken) / len(samples) > limit:
            where = self.save("reward errors", drop_first=True)
            raise RunStopped(
                f"{len(broken)} of {len(samples)} samples of step {step} had reward errors (more than "
                f"max_reward_error_frac={limit}); one of them: {broken[0].reward_error}. "
                f"Step {self.step} is saved in {where}; fix the reward and resume with --resume"
            )

    def _record(self, step, groups, batches: list[RolloutBatch], train_metrics, staleness, t0, t_wait, push_refs):
        import ray

        tc, ec = self.config.train, self.config.eval
        record: dict[str, Any] = {"step": step, **summarize_groups(groups), **train_metrics}
        gen_tokens = sum(b.gen_tokens for b in batches)
        gen_seconds = max(b.gen_seconds for b in batches)
        push_s = max(ray.get(push_refs)) if tc.max_staleness == 0 and push_refs else None
        if ec.every_steps > 0 and (step % ec.every_steps == 0 or step == tc.steps):
            record.update(self.evaluate(step))
        record.update(
            {
                "staleness/mean": sum(staleness) / len(staleness),
                "time/gen_s": gen_seconds,
                # Summed over the step's requests (workers score in parallel, so it can exceed gen_s).
                "time/reward_s": sum(b.reward_seconds for b in batches),
                "time/wait_rollout_s": t_wait,
                "time/push_s": push_s,
                "time/step_s": time.perf_counter() - t0,
                "throughput/gen_tokens_per_s": gen_tokens / max(gen_seconds, 1e-9),
                # Wall time since train() was called, start-up included.
                "time/elapsed_s": time.perf_counter() - self.started,
            }
        )
        return record

    def evaluate(self, step: int) -> dict[str, float]:
        import ray

        rc, ec = self.config.rollout, self.config.eval
        if not self.eval_rows or ec.every_steps <= 0:
            return {}
        max_tokens = ec.max_new_tokens or rc.max_new_tokens
        out = ray.get(self.workers[0].evaluate.remote(self.eval_rows, max_tokens, ec.correct_threshold))
        return {
            "eval/accuracy": out["correct"] / len(self.eval_rows),
            "eval/reward_mean": sum(out["rewards"]) / len(self.eval_rows),
            "eval/policy_version": out["policy_version"],
        }
