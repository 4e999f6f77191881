"""`titanrl.train(config)`: checks the config and data, starts the actors, runs the loop, cleans up.

The parts live in their own modules: the run directory (`run_dir`), Ray start-up
(`ray_runtime`), the request queue (`rollout_requests`), the step loop and its checkpoints
(`loop`). This file only orders them and makes sure that whatever happens (an exception,
Ctrl-C, a broken reward), the last completed step is saved and no actor outlives the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.config import RunConfig, validate
from titanrl.data import load_run_rows
from titanrl.loop import GRPOLoop, RunStopped, say
from titanrl.metrics import MetricsLogger, plot_run, read_metrics
from titanrl.ray_runtime import init_ray, ship_user_code_by_value
from titanrl.run_dir import create_run_dir, reopen_run_dir, set_aside_after

__all__ = ["RunResult", "RunStopped", "init_ray", "train"]


@dataclass
class RunResult:
    """What `train` returns."""

    run_dir: Path
    """Where metrics, plots, rollouts and checkpoints were written."""
    final_checkpoint: Path | None
    """HF checkpoint directory of the final policy."""
    metrics: list[dict[str, Any]]
    """Every record of metrics.jsonl, in order."""


def train(config: RunConfig, resume: bool = False) -> RunResult:
    """Runs GRPO as configured and returns where the results are.

    With `resume=True`, continues the run in `config.output.dir` from its newest complete
    checkpoint; metrics rows of later steps are moved to `metrics.jsonl.before-resume`.
    Raises `RunStopped` (after saving a checkpoint) when the run cannot go on.
    """
    started = time.perf_counter()
    validate(config)
    train_rows, eval_rows = load_run_rows(config)
    checkpoint = None
    if resume:
        run_dir, checkpoint = reopen_run_dir(config)
        set_aside_after(run_dir, checkpoint.step)
    else:
        run_dir = create_run_dir(config)

    import ray

    from titanrl.rollout.worker import RolloutWorker
    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.trainer.trainer_group import TrainerGroup

    say(f"run directory {run_dir}; starting Ray")
    init_ray()
    ship_user_code_by_value(config.rewards + ([config.env.factory] if config.env.factory is not None else []))
    rc, tc = config.rollout, config.train
    # A parallel layout runs as a group of rank actors behind the same interface.
    trainer_cls = TrainerGroup if tc.parallel.world_size > 1 else GRPOTrainer
    trainer = ray.remote(trainer_cls).options(num_cpus=0).remote(
        config.model, tc, rc.temperature, config.seed, batch_invariant=config.batch_invariant
    )
    workers = [
        ray.remote(RolloutWorker)
        .options(num_cpus=0)
        .remote(
            i, config.model, rc, config.rewards, config.data.prompt_field, config.seed, config.env,
            reward_timeout_s=config.reward_timeout_s, reward_error_value=config.reward_error_value,
            batch_invariant=config.batch_invariant,
        )
        for i in range(rc.num_workers)
    ]
    logger = MetricsLogger(run_dir, tensorboard=config.output.tensorboard)
    loop = GRPOLoop(config, trainer, workers, logger, run_dir, train_rows, eval_rows, started)
    final: Path | None = None
    try:
        t0 = time.perf_counter()
        say(f"starting the trainer and {len(workers)} vLLM rollout worker(s) (~20 s on CPU)")
        ray.get([w.ready.remote() for w in workers] + [trainer.get_version.remote()])
        say(f"actors ready in {time.perf_counter() - t0:.0f} s")
        if checkpoint is not None:
            loop.restore(checkpoint)
        final = loop.run()
    except RunStopped as e:
        say(str(e))
        raise
    except BaseException as e:
        reason = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        where = loop.save_after_failure(reason)
        if where is not None:
            say(f"run stopped at step {loop.step}: {reason}; saved {where} (continue with --resume)")
        if isinstance(e, KeyboardInterrupt):
            raise
        raise RunStopped(f"{reason}" + (f"; step {loop.step} saved in {where}" if where else "")) from e
    finally:
        logger.close()
        _shut_down(workers, trainer)
        if (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0:
            plot_run(run_dir)
    return RunResult(run_dir, final, read_metrics(run_dir))


def _shut_down(workers: list[Any], trainer: Any) -> None:
    """Closes engines inside their actors first (the multiprocess engine leaves shared memory otherwise)."""
    import ray

    closing = []
    for w in workers:
        try:
            closing.append(w.close.remote())
        except Exception:  # an actor that already died has nothing to close
            pass
    try:
        ray.wait(closing, num_returns=len(closing), timeout=60)
    except Exception:
        pass
    for actor in [*workers, trainer]:
        try:
            ray.kill(actor)
        except Exception:
            pass
