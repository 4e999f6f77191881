"""`titanrl.train(config)`: checks the config and data, starts the actors, runs the loop, cleans up.

The parts live in their own modules: the run directory (`titanrl.rundir.layout`), Ray start-up
(`ray_runtime`), the actors (`actors`), the rollout side (`sources.lockstep` for lock-step
runs, `sources.continuous` with the trajectory `sources.buffer` for continuous ones), the step
loop and its checkpoints (`loop`). This file only orders them and makes sure that whatever
happens (an exception, Ctrl-C, a broken reward, a dead actor), the last completed step is saved
and no actor outlives the run. Progress messages go to `logging.getLogger("titanrl")`, shown on
stderr as `[titanrl] ...` (`log.show_messages`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.busy_flags import BusyFlags
from titanrl.config import RunConfig, validate
from titanrl.config.record import config_record
from titanrl.config.resolve import ResolvedRunConfig, resolve
from titanrl.data import load_run_rows, longest_prompt_tokens
from titanrl.driver.actors import shut_down, start_rollouts, start_trainer
from titanrl.driver.log import show_messages
from titanrl.driver.loop import GRPOLoop
from titanrl.driver.out_of_memory import memory_hint
from titanrl.driver.placement import Placement
from titanrl.driver.ray_runtime import init_ray, ship_user_code_by_value
from titanrl.driver.signals import SigtermAsInterrupt
from titanrl.driver.weight_transport import choose_weight_transport, shm_free_bytes
from titanrl.errors import RunStopped, RunTerminated, TrainerLost
from titanrl.planning.fit import with_memory_plan
from titanrl.rundir.driver_state import read_driver_state
from titanrl.rundir.layout import create_run_dir, reopen_run_dir, set_aside_after, write_resolved_config
from titanrl.rundir.checkpoints import RunCheckpoint, latest_checkpoint
from titanrl.rundir.metrics import MetricsLogger, read_metrics
from titanrl.rundir.progress import plot_run
from titanrl.rundir.wandb_mirror import WandbMirror

__all__ = ["RunResult", "RunStopped", "init_ray", "train"]

log = logging.getLogger("titanrl")


@dataclass
class RunResult:
    """What `train` returns."""

    run_dir: Path
    """Where metrics, plots, rollouts and checkpoints were written."""
    final_checkpoint: Path | None
    """HF checkpoint directory of the final policy."""
    metrics: list[dict[str, Any]]
    """Every record of metrics.jsonl, in order."""


def resolve_run(config: RunConfig) -> tuple[ResolvedRunConfig, list[dict[str, Any]], list[dict[str, Any]]]:
    """The validated config with every derived value filled and its `auto` memory settings chosen
    (refused here when the memory plan says nothing fits), and its train and eval rows. What
    `train` and `titanrl train --print-config` both start from; nothing is started."""
    validate(config)
    resolved = resolve(config)
    train_rows, eval_rows = load_run_rows(config)
    resolved = with_memory_plan(resolved, longest_prompt=longest_prompt_tokens(config, train_rows))
    return resolved, train_rows, eval_rows


def train(config: RunConfig, resume: bool = False) -> RunResult:
    """Runs GRPO as configured and returns where the results are.

    With `resume=True`, continues the run in `config.output.dir` from its newest complete
    checkpoint; metrics rows of later steps are moved to `metrics.jsonl.before-resume`.
    Raises `RunStopped` (after saving a checkpoint) when the run cannot go on. Ctrl-C and
    SIGTERM both save the last completed step and shut the actors down; then Ctrl-C raises
    `KeyboardInterrupt` and SIGTERM `RunTerminated` (a `SystemExit` with status 143).
    """
    started = time.perf_counter()
    show_messages()
    resolved, train_rows, eval_rows = resolve_run(config)
    for line in resolved.memory_summary:
        log.info(line)
    checkpoint, driver_state = None, None
    if resume:
        run_dir, checkpoint = reopen_run_dir(config)
        driver_state = read_driver_state(checkpoint.path)  # a format it cannot read is refused before start-up
        set_aside_after(run_dir, checkpoint.step)
    else:
        run_dir = create_run_dir(config)
    write_resolved_config(run_dir, resolved)
    config = resolved.config


    log.info(f"run directory {run_dir}; " + (f"joining Ray at {config.ray_address}" if config.ray_address else "starting Ray"))
    init_ray(address=config.ray_address)
    sigterm = SigtermAsInterrupt().install()  # after ray.init, which installs its own handler
    try:
        for attempt in range(AUTO_RESUME_ATTEMPTS + 1):
            try:
                return _run(resolved, run_dir, checkpoint, driver_state, eval_rows, train_rows, started, sigterm,
                            after_loss=attempt > 0)
            except TrainerLost as e:
                newest = latest_checkpoint(run_dir)
                if not config.train.auto_resume or attempt == AUTO_RESUME_ATTEMPTS or newest is None:
                    raise
                # The newest checkpoint is the run now: later metrics rows are set aside, as --resume does.
                checkpoint, driver_state = newest, read_driver_state(newest.path)
                set_aside_after(run_dir, checkpoint.step)
                log.info(f"the trainer was lost ({e}); train.auto_resume: resuming from step {checkpoint.step} "
                         f"once the cluster has room (attempt {attempt + 1} of {AUTO_RESUME_ATTEMPTS}, up to "
                         f"cluster.placement_timeout_s={config.cluster.placement_timeout_s:g} s for the placement)")
        raise AssertionError("unreachable")
    except KeyboardInterrupt as e:
        if not sigterm.received:
            raise
        log.info("run stopped during start-up: terminated (SIGTERM)")  # before the loop: nothing to save
        raise RunTerminated("terminated (SIGTERM) during start-up") from e
    finally:
        sigterm.uninstall()


AUTO_RESUME_ATTEMPTS = 3
"""How many times `train.auto_resume` resumes a run whose trainer was lost."""


def _is_the_trainers_death(error: BaseException, trainer: Any) -> bool:
    """Whether the run stopped because the trainer's own actor died (its process, or its node): an
    actor error, and the trainer no longer answers. (Rollout workers' deaths are handled where
    they happen; one that escapes is not the trainer's.)"""
    import ray
    from ray.exceptions import RayActorError

    if not isinstance(error, RayActorError):
        return False
    try:
        ray.get(trainer.get_version.remote(), timeout=60)
    except RayActorError:
        return True
    except Exception:  # noqa: BLE001 - alive but busy or slow: not a lost trainer
        return False
    return False


def _run(resolved: ResolvedRunConfig, run_dir: Path, checkpoint: RunCheckpoint | None, driver_state: dict[str, Any] | None,
         eval_rows: list[dict[str, Any]], train_rows: list[dict[str, Any]], started: float,
         sigterm: SigtermAsInterrupt, after_loss: bool = False) -> RunResult:
    """Starts the actors, runs (or resumes) the loop, saves on any failure, and shuts everything down.
    after_loss: resuming after the trainer was lost, so the placement waits for its node to come back."""
    import ray

    config = resolved.config
    ship_user_code_by_value(config.rewards + [fn for fn in (config.env.factory, config.agent.fn) if fn is not None])
    placement = Placement.create(config, wait_for_nodes=after_loss)
    try:
        transport = choose_weight_transport(config, placement.layout.rollout_device, shm_free_bytes())
        sync_options = placement.weight_sync_options(transport)
        resolved = resolved.placed(placement.layout.trainer_device, transport)
        write_resolved_config(run_dir, resolved)  # now with the device and transport the cluster gave
    except BaseException:
        placement.remove()
        raise
    config = resolved.config
    # The workers' busy bytes, for a trainer that takes their cores while they wait.
    busy = (
        BusyFlags.create(config.rollout.num_workers)
        if config.train.compute.threads_when_rollouts_idle is not None
        else None
    )
    busy_path = None if busy is None else busy.path
    try:
        trainer = start_trainer(resolved, placement, busy_flags=busy_path)
        rollouts = start_rollouts(resolved, train_rows, placement, busy_flags=busy_path)
    except BaseException:
        placement.remove()
        if busy is not None:
            busy.unlink()
        raise
    if config.ray_address:
        log.info(f"placed {placement.summary()}")
    mirror = WandbMirror.start(config.output, run_dir, config_record(config))  # None when off or failed
    logger = MetricsLogger(run_dir, tensorboard=config.output.tensorboard, wandb=mirror)
    loop = GRPOLoop(config, trainer, rollouts, logger, run_dir, eval_rows, started)
    final: Path | None = None
    try:
        t0 = time.perf_counter()
        log.info(f"starting the trainer and {len(rollouts.workers)} vLLM rollout worker(s) (~20 s on CPU)")
        ray.get([w.ready.remote() for w in rollouts.workers] + [trainer.get_version.remote()])
        rollouts.open_weight_sync(trainer, transport, **sync_options)
        meeting = f" from {sync_options['host']}:{sync_options['port']}" if "host" in sync_options else ""
        log.info(f"actors ready in {time.perf_counter() - t0:.0f} s (weights by {transport}{meeting})")
        if checkpoint is not None:
            loop.restore(checkpoint, driver_state)
        final = loop.run()
    except RunStopped as e:
        log.info(str(e))
        raise
    except BaseException as e:
        terminated = sigterm.received and isinstance(e, KeyboardInterrupt)
        if terminated:
            reason = "terminated (SIGTERM)"
        else:
            reason = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        where = loop.save_after_failure(reason)
        reason += memory_hint(e)
        stopped = f"run stopped after step {loop.step}: {reason}"
        if where is not None:
            log.info(f"{stopped}; newest checkpoint {where} (continue with --resume)")
        elif terminated:
            log.info(stopped)  # the one line that says why the process ends
        if terminated:
            raise RunTerminated(f"{stopped}" + (f"; the newest checkpoint is {where}" if where else "")) from e
        if isinstance(e, KeyboardInterrupt):
            raise
        stop = TrainerLost if _is_the_trainers_death(e, trainer) else RunStopped
        raise stop(f"{reason}" + (f"; the newest checkpoint is {where}" if where else "")) from e
    finally:
        logger.close(failed=final is None)
        shut_down(rollouts, trainer)
        placement.remove()  # after the actors closed their engines: removal kills what is left in it
        if busy is not None:
            busy.unlink()
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0:
            plot_run(run_dir)
    return RunResult(run_dir, final, read_metrics(run_dir))
