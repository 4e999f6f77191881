"""The run's Ray actors: the trainer (one process or a parallel group) and the rollout side.

`start_trainer` and `start_rollouts` create the actors, from the resolved and placed config
(`titanrl.config.resolve`), without waiting for them: each actor gets it whole (a worker) or the
`TrainerSetup` made from it (the trainer); `shut_down`
closes engines inside their actors before killing them (a multiprocess engine would leave its
shared memory behind otherwise).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

from titanrl.config.resolve import ResolvedRunConfig
from titanrl.config.xla_env import xla_runtime_env
from titanrl.data import PromptStream
from titanrl.driver.elastic import ElasticCapacity
from titanrl.driver.placement import Placement, WorkerHome
from titanrl.driver.sources.base import RolloutSource
from titanrl.driver.sources.continuous import ContinuousRollouts
from titanrl.driver.sources.lockstep import LockstepRollouts
from titanrl.rollout.seeds import request_seed
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.truncation import Truncation

log = logging.getLogger("titanrl")


def trainer_setup(resolved: ResolvedRunConfig) -> TrainerSetup:
    """What the trainer actor is built from: the run's `model`, `train` and `lora` sections, the
    sampling temperature and truncation it scores tokens under, and the device the placement reserved."""
    config = resolved.config
    return TrainerSetup(model=config.model, train=config.train, temperature=config.rollout.sampling.temperature,
                        seed=config.seed, batch_invariant=config.batch_invariant,
                        truncation=Truncation.scored_by_trainer(config.rollout), device_type=resolved.trainer_device,
                        lora=config.lora)


def start_trainer(resolved: ResolvedRunConfig, placement: Placement, *, xla_device_type: str = "xla",
                  busy_flags: str | None = None) -> Any:
    """The trainer actor: `GRPOTrainer`, or `TrainerGroup` (same interface) for a parallel layout.

    With train.compute.device='xla' it is one `GRPOTrainer` (the parallel degrees are its SPMD mesh) under
    the XLA environment's interpreter (`titanrl.config.xla_env`). xla_device_type: the device it
    trains on there; tests pass 'cpu' to run that actor on torch_xla's torch without XLA.
    busy_flags: the run's `titanrl.busy_flags` file (train.compute.threads_when_rollouts_idle), or None.
    """
    import ray

    from titanrl.trainer.trainer import GRPOTrainer
    from titanrl.trainer.trainer_group import TrainerGroup

    tc = resolved.config.train
    options, kwargs = placement.trainer_options(), placement.trainer_kwargs()
    setup = trainer_setup(resolved)
    if tc.compute.device == "xla":
        options["runtime_env"] = xla_runtime_env(tc)
        setup = dataclasses.replace(setup, device_type=xla_device_type)
        trainer_cls: type = GRPOTrainer
    else:
        trainer_cls = TrainerGroup if tc.parallel.world_size > 1 else GRPOTrainer
    if busy_flags is not None:
        kwargs["busy_flags"] = busy_flags
    return ray.remote(trainer_cls).options(**options).remote(setup, **kwargs)


def start_rollouts(resolved: ResolvedRunConfig, train_rows: list[dict[str, Any]],
                   placement: Placement, busy_flags: str | None = None) -> RolloutSource:
    """The rollout workers and the source of each step's groups (`rollout.continuous` picks which);
    worker i (and any replacement of it) runs in the placement's bundle for worker i and raises
    byte i of `busy_flags` (the run's `titanrl.busy_flags` file, or None) while it samples."""
    import ray

    from titanrl.rollout.continuous_worker import ContinuousRolloutWorker
    from titanrl.rollout.worker import RolloutWorker

    config = resolved.config
    rc, tc = config.rollout, config.train
    stream = PromptStream(train_rows, rc.prompts_per_step, config.data.shuffle_seed + config.seed)
    turns = config.calls_per_episode
    if not rc.continuous:
        lockstep_cls = ray.remote(RolloutWorker)

        def make_lockstep_worker(i: int) -> Any:
            _wait_for_slot(placement, i, config.cluster.placement_timeout_s)
            return lockstep_cls.options(**placement.worker_options(i)).remote(i, resolved, busy_flags=busy_flags)

        return LockstepRollouts(make_lockstep_worker, rc.num_workers, stream, config.seed, rc.group_size, turns,
                                tc.max_staleness, tc.steps,
                                dynamic_sampling_max_requests=rc.shaping.dynamic_sampling_max_requests
                                if rc.shaping.dynamic_sampling else 0)

    # An async actor: its group streams (at most one call per admitted group), weight loads and
    # evaluations run on it at once (see ContinuousRolloutWorker).
    most_in_flight = (1 + tc.max_staleness) * rc.prompts_per_step
    worker_cls = ray.remote(ContinuousRolloutWorker)

    added_ids = itertools.count(rc.num_workers)  # an elastic run's added workers

    def make_worker(home: int | WorkerHome) -> Any:
        """Worker slot `home` of the run's placement, or (rollout.elastic) a worker in `home`."""
        if isinstance(home, int):
            worker_id, flags, home = home, busy_flags, placement.worker_home(home)
        else:  # validation refuses busy flags with rollout.elastic: the file has num_workers bytes
            worker_id, flags = next(added_ids), None
        _wait_for_slot(placement, home, config.cluster.placement_timeout_s)
        return worker_cls.options(max_concurrency=most_in_flight + 16, **placement.home_options(home)).remote(
            worker_id, resolved, busy_flags=flags)

    return ContinuousRollouts.for_run(
        make_worker, rc.num_workers, stream, rc.prompts_per_step, tc.max_staleness, tc.steps,
        lambda group_id: request_seed(config.seed, group_id, rc.group_size, turns),
        elastic=ElasticCapacity(placement) if rc.elastic else None,
    )


def _wait_for_slot(placement: Placement, home: int | WorkerHome, timeout_s: float) -> None:
    """The worker's bundle on a live node before its actor starts: a replacement after a lost node
    would otherwise be scheduled onto the dead node (and die again) while Ray places the bundle anew."""
    home = placement.worker_home(home) if isinstance(home, int) else home
    waited = placement.wait_for_home(home, timeout_s)
    if waited > 1.0:
        log.info(f"a rollout worker's slot is on a live node again after {waited:.0f} s")


def shut_down(rollouts: RolloutSource, trainer: Any) -> None:
    """Closes the weight transport and the engines inside their actors first, then kills every actor
    (dead ones are skipped)."""
    import ray

    try:
        rollouts.close()
    except Exception:  # e.g. the trainer died: its end of the transport is gone already
        pass
    workers = rollouts.workers
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
