"""`titanrl.train(config)`: builds the Ray actors, runs the rollout/train loop, owns the run directory.

The loop keeps `1 + train.max_staleness` generation requests in flight. Each step takes the
oldest finished request, trains on it, and queues the new weights to every worker behind
the requests already queued there (Ray runs an actor's calls in order). With
`max_staleness=0` this is synchronous on-policy GRPO; with 1, generation of the next batch
overlaps training on the current one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.config import ConfigError, RunConfig, validate
from titanrl.data import PromptStream, load_rows
from titanrl.metrics import MetricsLogger, plot_run, read_metrics
from titanrl.types import Group, RolloutBatch


@dataclass
class RunResult:
    """What `train` returns."""

    run_dir: Path
    """Where metrics, plots, rollouts and checkpoints were written."""
    final_checkpoint: Path | None
    """HF checkpoint directory of the final policy."""
    metrics: list[dict[str, Any]]
    """Every record of metrics.jsonl, in order."""


def prepare_run_dir(path: str) -> Path:
    run_dir = Path(path or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"output.dir {str(run_dir)!r} already holds a run (metrics.jsonl); "
            "choose a new directory so nothing written before is overwritten"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _say(message: str) -> None:
    print(f"[titanrl] {message}", file=sys.stderr, flush=True)


def _config_record(config: RunConfig) -> dict[str, Any]:
    def name(fn: Any) -> str:
        return fn if isinstance(fn, str) else f"{fn.__module__}:{getattr(fn, '__qualname__', type(fn).__name__)}"

    env = dataclasses.replace(config.env, factory=None)
    record = dataclasses.asdict(dataclasses.replace(config, rewards=[], env=env))
    record["rewards"] = [name(r) for r in config.rewards]
    record["env"]["factory"] = None if config.env.factory is None else name(config.env.factory)
    return record


def init_ray(num_cpus: int | None = None) -> None:
    """Starts a local Ray instance for TitanRL's actors, unless one is already running.

    Its traffic stays on loopback: Ray turns "127.0.0.1" into the host's routable address
    unless its multi-node mode is off (the switch it uses on macOS), so turn it off here;
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 to opt back in.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    # The constant is read when Ray is imported, which may have happened before this call.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")
    # Actors must import whatever the driver imported the reward functions from.
    pythonpath = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    ray.init(
        # Keep Ray's own traffic on loopback: a single-machine run needs no other address.
        _node_ip_address="127.0.0.1",
        num_cpus=num_cpus or os.cpu_count() or 1,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=True,
        runtime_env={"env_vars": {
            "PYTHONPATH": pythonpath,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # vLLM's CPU start-up warnings (tcmalloc, Triton, NUMA) are noise for a user; export
            # VLLM_LOGGING_LEVEL=WARNING (or INFO) to see them.
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning"),
        }},
    )


def _ship_user_code_by_value(callables: list[Any]) -> None:
    """Rewards and env factories from user files travel to the actors by value.

    Actors may not be able to import a config file's neighbours by name (Ray may have been
    started before that folder went on sys.path), so anything not from an installed package
    is pickled with its module's code instead of as an import reference.
    """
    import sysconfig

    from ray import cloudpickle

    installed = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    installed.add(Path(__file__).resolve().parent)  # titanrl itself
    for fn in callables:
        if isinstance(fn, str):
            continue
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        file = getattr(module, "__file__", None)
        if module is None or module.__name__ == "__main__" or file is None:
            continue  # cloudpickle already sends __main__ by value
        path = Path(file).resolve()
        if not any(root == path or root in path.parents for root in installed):
            cloudpickle.register_pickle_by_value(module)


def _summarize_groups(groups: list[Group]) -> dict[str, float]:
    rewards = [s.reward for g in groups for s in g.samples]
    lengths = [len(s.completion_ids) for g in groups for s in g.samples]
    n = len(rewards)
    mean = sum(rewards) / n
    solved = sum(any(r > 0 for r in g.rewards) for g in groups)
    env_stats: dict[str, float] = {}
    stats = [s.stats for g in groups for s in g.samples if s.stats]
    if stats:
        # Per-step totals for counters, a mean for turns: what a dashboard should show.
        env_stats = {
            "env/turns_mean": sum(st.get("turns", 0.0) for st in stats) / len(stats),
            "env/tool_calls": sum(st.get("tool_calls", 0.0) for st in stats),
            "env/errors": sum(st.get("errors", 0.0) for st in stats),
            "env/sandbox_s": sum(st.get("sandbox_s", 0.0) for st in stats),
        }
        total_tests = sum(st.get("tests_total", 0.0) for st in stats)
        if total_tests:
            env_stats["env/tests_pass_rate"] = sum(st.get("tests_passed", 0.0) for st in stats) / total_tests
    return {
        **env_stats,
        "reward/mean": mean,
        "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "reward/group_any_positive_frac": solved / len(groups),
        "completion/len_mean": sum(lengths) / n,
        "completion/truncated_frac": sum(not s.finished for g in groups for s in g.samples) / n,
    }


def train(config: RunConfig) -> RunResult:
    """Runs GRPO as configured and returns where the results are."""
    started = time.perf_counter()
    validate(config)
    train_rows = load_rows(config.data.train_file, config.data.prompt_field)
    eval_rows = load_rows(config.data.eval_file, config.data.prompt_field) if config.data.eval_file else []
    eval_rows = eval_rows[: config.eval.max_prompts]
    run_dir = prepare_run_dir(config.output.dir)
    (run_dir / "config.json").write_text(json.dumps(_config_record(config), indent=2) + "\n")

    import ray

    from titanrl.rollout.worker import RolloutWorker
    from titanrl.trainer.trainer import GRPOTrainer

    _say(f"run directory {run_dir}; starting Ray")
    init_ray()
    _ship_user_code_by_value(config.rewards + ([config.env.factory] if config.env.factory is not None else []))
    rc, tc = config.rollout, config.train
    trainer = ray.remote(GRPOTrainer).options(num_cpus=0).remote(config.model, tc, rc.temperature, config.seed)
    workers = [
        ray.remote(RolloutWorker)
        .options(num_cpus=0)
        .remote(
            i, config.model, rc, config.rewards, config.data.prompt_field, config.seed, config.env
        )
        for i in range(rc.num_workers)
    ]
    logger = MetricsLogger(run_dir, tensorboard=config.output.tensorboard)
    final: Path | None = None
    try:
        t0 = time.perf_counter()
        _say(f"starting the trainer and {len(workers)} vLLM rollout worker(s) (~20 s on CPU)")
        ray.get([w.ready.remote() for w in workers] + [trainer.get_version.remote()])
        _say(f"actors ready in {time.perf_counter() - t0:.0f} s")
        final = _run_loop(config, trainer, workers, logger, train_rows, eval_rows, run_dir, started)
    finally:
        logger.close()
        for w in workers:
            try:
                ray.get(w.close.remote(), timeout=60)
            except Exception:  # an actor that already died has nothing to close
                pass
            ray.kill(w)
        ray.kill(trainer)
        if (run_dir / "metrics.jsonl").stat().st_size > 0:
            plot_run(run_dir)
    return RunResult(run_dir, final, read_metrics(run_dir))


def _run_loop(config, trainer, workers, logger, train_rows, eval_rows, run_dir: Path, started: float) -> Path:
    import ray
    from tqdm import tqdm

    rc, tc, ec = config.rollout, config.train, config.eval
    stream = PromptStream(train_rows, rc.prompts_per_step, config.data.shuffle_seed + config.seed)
    in_flight: deque[list[ray.ObjectRef]] = deque()
    next_group_id = 0
    request_index = 0

    def submit() -> None:
        nonlocal next_group_id, request_index
        rows = stream.next_batch()
        per_worker = [rows[i :: len(workers)] for i in range(len(workers))]
        refs = []
        for w, chunk in zip(workers, per_worker, strict=True):
            if chunk:
                # Distinct seeds per request and worker keep every sample's stream unique.
                seed = config.seed * 1_000_003 + request_index * 10_007 + len(refs) * 101
                refs.append(w.generate.remote(chunk, seed, next_group_id))
                next_group_id += len(chunk)
        request_index += 1
        in_flight.append(refs)

    def evaluate(step: int) -> dict[str, float]:
        if not eval_rows or ec.every_steps <= 0:
            return {}
        max_tokens = ec.max_new_tokens or rc.max_new_tokens
        out = ray.get(workers[0].evaluate.remote(eval_rows, max_tokens, ec.correct_threshold))
        return {
            "eval/accuracy": out["correct"] / len(eval_rows),
            "eval/reward_mean": sum(out["rewards"]) / len(eval_rows),
            "eval/policy_version": out["policy_version"],
        }

    initial_eval = evaluate(0)
    if initial_eval:
        logger.log({"step": 0, **initial_eval, "time/elapsed_s": time.perf_counter() - started})
    bar = tqdm(total=tc.steps, desc="GRPO", unit="step", disable=not config.output.progress_bar, dynamic_ncols=True)
    if initial_eval:
        bar.set_postfix(eval_acc=f"{initial_eval['eval/accuracy']:.2f}")
    for _ in range(1 + tc.max_staleness):
        submit()
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        batches: list[RolloutBatch] = ray.get(in_flight.popleft())
        t_wait = time.perf_counter() - t0
        groups = [g for b in batches for g in b.groups]
        version = step - 1  # trainer's version before this step
        staleness = [version - g.policy_version for g in groups]
        if max(staleness) > tc.max_staleness:  # the loop's invariant; never train on older data
            raise RuntimeError(f"rollout staleness {max(staleness)} exceeds train.max_staleness={tc.max_staleness}")
        # Keep the pipeline full, but never generate batches no step will consume.
        submit_after_push = step + tc.max_staleness < tc.steps
        train_metrics = ray.get(trainer.step.remote(groups))
        weights = trainer.state_dict_for_push.remote()
        push_refs = [w.update_weights.remote(weights, step) for w in workers]
        if submit_after_push:
            submit()
        record: dict[str, Any] = {"step": step, **_summarize_groups(groups), **train_metrics}
        gen_tokens = sum(b.gen_tokens for b in batches)
        gen_seconds = max(b.gen_seconds for b in batches)
        push_s = max(ray.get(push_refs)) if tc.max_staleness == 0 else None
        if ec.every_steps > 0 and (step % ec.every_steps == 0 or step == tc.steps):
            record.update(evaluate(step))
        record.update(
            {
                "staleness/mean": sum(staleness) / len(staleness),
                "time/gen_s": gen_seconds,
                "time/wait_rollout_s": t_wait,
                "time/push_s": push_s,
                "time/step_s": time.perf_counter() - t0,
                "throughput/gen_tokens_per_s": gen_tokens / max(gen_seconds, 1e-9),
                "policy_version": step,
                # Wall time since train() was called, start-up included.
                "time/elapsed_s": time.perf_counter() - started,
            }
        )
        logger.log(record)
        logger.log_rollouts(step, _rollout_rows(groups[: config.output.rollouts_per_step]))
        postfix = {"reward": f"{record['reward/mean']:.2f}", "loss": f"{record['loss']:.3f}"}
        if "eval/accuracy" in record:
            postfix["eval_acc"] = f"{record['eval/accuracy']:.2f}"
        bar.set_postfix(postfix)
        bar.update(1)
        if config.output.save_every_steps and step % config.output.save_every_steps == 0 and step != tc.steps:
            ray.get(trainer.save.remote(str(run_dir / "checkpoints" / f"step_{step:06d}")))
    bar.close()
    return Path(ray.get(trainer.save.remote(str(run_dir / "final"))))


def _rollout_rows(groups: list[Group]) -> list[dict[str, Any]]:
    return [
        {
            "group_id": s.group_id,
            "prompt": s.prompt,
            "completion": s.completion,
            "reward": s.reward,
            "policy_version": s.policy_version,
            "num_tokens": len(s.completion_ids),
        }
        for g in groups
        for s in g.samples
    ]
