"""The GRPO loop: take the next step's rollouts, train on them, publish the weights, admit more.

The rollout side is a `RolloutSource` (`titanrl.driver.sources.base`): `LockstepRollouts`
(`sources.lockstep`: one fixed batch per worker per step, `1 + max_staleness` requests queued,
reproducible to the bit) or `ContinuousRollouts` (`sources.continuous`: group by group into the
trajectory buffer, weights taken between engine steps). With `max_staleness=0` both are
synchronous on-policy GRPO.

Everything the loop needs to continue is in a checkpoint (`save`): the trainer's model,
optimizer, scheduler and RNG; the data-stream position; the rollout side's queue or buffer,
with the finished rollouts of older policies that no step has trained on yet.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from titanrl.config import RunConfig
from titanrl.driver.overlong_filter import OVERLONG_FILTERED, filter_overlong
from titanrl.driver.sources.base import RolloutSource, RolloutWorkersFailed
from titanrl.errors import RunStopped
from titanrl.rundir.checkpoints import RunCheckpoint, checkpoint_path, latest_checkpoint, writing_checkpoint
from titanrl.rundir.driver_state import DRIVER_STATE, read_driver_state, write_driver_state
from titanrl.rundir.metrics import MetricsLogger
from titanrl.rundir.plain import from_plain, to_plain
from titanrl.rewards.health import RewardHackingWatch, reward_health
from titanrl.rewards.metrics import MEAN, reward_term_metrics
from titanrl.rundir.rollout_log import rollout_rows, summarize_groups
from titanrl.trainer.checkpoint import rng_state, set_rng_state
from titanrl.types import Group, StepRollouts
from titanrl.weight_sync import WeightPush

TRAINER_STATE = "trainer"

log = logging.getLogger("titanrl")


class GRPOLoop:
    """Drives one run's trainer (a Ray actor handle) and rollout side step by step."""

    def __init__(
        self,
        config: RunConfig,
        trainer: Any,
        rollouts: RolloutSource,
        logger: MetricsLogger,
        run_dir: Path,
        eval_rows: list[dict[str, Any]],
        started: float,
    ) -> None:
        self.config, self.trainer, self.rollouts, self.logger = config, trainer, rollouts, logger
        self.run_dir, self.eval_rows, self.started = run_dir, eval_rows, started
        self.step = 0
        """Last completed training step."""
        self.version = 0
        """Trainer's policy version after `step` (skipped steps do not advance it)."""
        self.saved_steps: set[int] = set()
        health = config.scoring.health
        self.hacking = RewardHackingWatch(health.hacking_window, health.hacking_reward_rise,
                                          health.hacking_accuracy_rise)

    # ------------------------------------------------------------------ resume

    def restore(self, checkpoint: RunCheckpoint, state: dict[str, Any] | None = None) -> None:
        """Continues from a checkpoint: trainer state, queue, RNG, and the workers' weights.

        `state` is its `read_driver_state` (read here when None; the driver reads it before
        starting any actor, so a checkpoint of an unreadable format costs no start-up).
        """
        import ray

        state = read_driver_state(checkpoint.path) if state is None else state
        version = ray.get(self.trainer.load_state.remote(str(checkpoint.path / TRAINER_STATE)))
        if version != state["policy_version"]:
            raise RuntimeError(f"{checkpoint.path}: trainer state has version {version}, driver state {state['policy_version']}")
        self.step, self.version = state["step"], version
        self.rollouts.restore(from_plain(self.rollouts.checkpoint_type, state["rollouts"], "rollouts"), version)
        set_rng_state(state["rng"])
        self.rollouts.publish(version).wait()
        self.saved_steps.add(self.step)
        exact = "" if state["exact"] else " (inexact: some rollouts are generated again)"
        log.info(f"resumed from {checkpoint.path} at step {self.step}, policy version {version}{exact}")

    # ------------------------------------------------------------------ checkpoints

    def save(self, reason: str, wait_s: float | None = None, drop_first: bool = False) -> Path:
        """Writes `checkpoints/step_N/` of the last completed step, atomically."""
        import ray

        queue_state = self.rollouts.checkpoint(self.version, wait_s=wait_s, drop_first=drop_first)
        driver_state = {
            "step": self.step,
            "policy_version": self.version,
            "exact": queue_state.exact,
            "rollouts": to_plain(queue_state, "rollouts"),
            "rng": rng_state(),
        }
        manifest = {"policy_version": self.version, "exact": queue_state.exact, "reason": reason,
                    "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with writing_checkpoint(self.run_dir, self.step, manifest) as tmp:
            ray.get(self.trainer.save_state.remote(str(tmp / TRAINER_STATE)))
            write_driver_state(tmp / DRIVER_STATE, driver_state)
        self.saved_steps.add(self.step)
        return checkpoint_path(self.run_dir, self.step)

    def save_after_failure(self, reason: str) -> Path | None:
        """Best-effort checkpoint after an exception or Ctrl-C; None (and a message) if impossible."""
        import ray

        try:
            # A step the trainer finished but the loop never recorded (interrupted while waiting).
            actual = ray.get(self.trainer.get_version.remote(), timeout=600)
            if actual > self.version and self.rollouts.has_untrained():
                self.rollouts.trained(self.step + 1)
                self.step, self.version = self.step + 1, actual
            if self.step == 0:
                return None  # nothing was trained yet: the initial checkpoint is the starting point
            if self.step in self.saved_steps:
                return checkpoint_path(self.run_dir, self.step)
            return self.save(reason, wait_s=30)
        except BaseException as e:  # the trainer itself may be what died
            newest = latest_checkpoint(self.run_dir)
            where = f"the newest checkpoint is {newest.path}" if newest else "there is no checkpoint yet"
            log.info(f"could not save a checkpoint after the failure ({type(e).__name__}: {e}); {where}")
            return newest.path if newest else None

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
        self.rollouts.fill(self.step, self.version)
        for step in range(self.step + 1, tc.steps + 1):
            try:
                record = self._one_step(step)
            except RolloutWorkersFailed as e:
                where = self.save("rollout workers failed")
                raise RunStopped(f"{e}. Step {self.step} is saved in {where}; resume with --resume") from e
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

    def _one_step(self, step: int) -> dict[str, Any]:
        import ray

        config, tc = self.config, self.config.train
        t0 = time.perf_counter()
        rollouts = self.rollouts.next_step(step)
        t_wait = time.perf_counter() - t0
        groups = rollouts.groups
        self._stop_if_rewards_broken(step, groups)
        staleness = [self.version - g.policy_version for g in groups]
        if max(staleness) > tc.max_staleness:  # the loop's invariant; never train on older data
            raise RuntimeError(f"rollout staleness {max(staleness)} exceeds train.max_staleness={tc.max_staleness}")
        filtered = None
        if config.rollout.shaping.overlong_filter:
            train_groups, filtered = filter_overlong(groups)
        train_metrics = ray.get(self.trainer.step.remote(train_groups if filtered is not None else groups))
        self.rollouts.trained(step)
        self.step, self.version = step, int(train_metrics["policy_version"])
        skipped = bool(train_metrics.get("train/skipped", 0.0))
        push = None if skipped else self.rollouts.publish(self.version)  # a refused step changed nothing
        self.rollouts.fill(self.step, self.version)
        record = self._record(step, rollouts, train_metrics, staleness, t0, t_wait, push)
        if filtered is not None:
            record[OVERLONG_FILTERED] = filtered
        self.logger.log(record)
        self.logger.log_rollouts(step, rollout_rows(groups, config.output.rollouts_per_step))
        if skipped and train_metrics.get("train/consecutive_skipped", 0) >= tc.max_skipped_steps:
            where = self.save("non-finite training")
            raise RunStopped(
                f"{int(train_metrics['train/consecutive_skipped'])} steps in a row had a non-finite loss or gradient "
                f"norm (loss {train_metrics.get('loss')}, grad_norm {train_metrics.get('grad_norm')}) and were skipped; "
                f"the last good policy (version {self.version}) is saved in {where}. Lower train.optimizer.lr, "
                "check the "
                "rewards, or raise train.max_skipped_steps"
            )
        return record

    def _stop_if_rewards_broken(self, step: int, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples]
        broken = [s for s in samples if s.reward_error]
        limit = self.config.scoring.max_error_frac
        if broken and len(broken) / len(samples) > limit:
            where = self.save("reward errors", drop_first=True)
            raise RunStopped(
                f"{len(broken)} of {len(samples)} samples of step {step} had reward errors (more than "
                f"scoring.max_error_frac={limit}); one of them: {broken[0].reward_error}. "
                f"Step {self.step} is saved in {where}; fix the reward and resume with --resume"
            )

    def _record(self, step: int, rollouts: StepRollouts, train_metrics: dict[str, Any], staleness: list[int],
                t0: float, t_wait: float, push: WeightPush | None) -> dict[str, Any]:
        tc, ec = self.config.train, self.config.eval
        rewards = reward_term_metrics(rollouts.groups)
        record: dict[str, Any] = {"step": step, **summarize_groups(rollouts.groups), **rewards,
                                  **reward_health(rollouts.groups, self.config.scoring.health.agreement_pairs),
                                  **train_metrics}
        self.hacking.step({key.split("/")[1]: value for key, value in rewards.items() if key.endswith(f"/{MEAN}")})
        # Lock-step on-policy: the next requests wait for the push anyway, so measure it here.
        if push is not None and tc.max_staleness == 0 and not self.config.rollout.continuous:
            record["time/weight_sync_s"] = push.wait()
        if ec.every_steps > 0 and (step % ec.every_steps == 0 or step == tc.steps):
            record.update(self.evaluate(step))
        record.update(
            {
                "staleness/mean": sum(staleness) / len(staleness),
                "staleness/max": max(staleness),
                # Samples whose tokens came from more than one version (continuous in-flight updates).
                "staleness/mixed_version_frac": _mixed_version_frac(rollouts.groups),
                "time/gen_s": rollouts.gen_seconds,
                "time/reward_s": rollouts.reward_seconds,
                "time/wait_rollout_s": t_wait,
                "time/step_s": time.perf_counter() - t0,
                "throughput/gen_tokens_per_s": rollouts.gen_tokens / max(rollouts.gen_seconds, 1e-9),
                **rollouts.metrics,
                # Wall time since train() was called, start-up included.
                "time/elapsed_s": time.perf_counter() - self.started,
            }
        )
        return record

    def evaluate(self, step: int) -> dict[str, float]:
        rc, ec = self.config.rollout, self.config.eval
        if not self.eval_rows or ec.every_steps <= 0:
            return {}
        max_tokens = ec.max_new_tokens or rc.sampling.max_new_tokens
        out = self.rollouts.evaluate(self.eval_rows, max_tokens, ec.correct_threshold, self.version)
        accuracy = out["correct"] / len(self.eval_rows)
        return {
            "eval/accuracy": accuracy,
            "eval/reward_mean": sum(out["rewards"]) / len(self.eval_rows),
            "eval/policy_version": out["policy_version"],
            **self.hacking.evaluation(accuracy),
        }


def _mixed_version_frac(groups: list[Group]) -> float:
    samples = [s for g in groups for s in g.samples]
    return sum(s.policy_version_max != s.policy_version for s in samples) / len(samples)
