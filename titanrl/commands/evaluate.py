"""`titanrl eval CHECKPOINT --config CONFIG.py [--k K]`: held-out greedy accuracy and pass@k.

Runs one RolloutWorker in this process (no Ray) on the checkpoint with the config's rewards
(weighted by its reward_weights) or environment, and its eval rows (data.eval_file, or
data.eval_rows from a Python config): the same scoring the training run's `eval/accuracy` uses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.commands import CommandError
from titanrl.commands.export import find_run_policy, write_hf
from titanrl.config import RunConfig, validate
from titanrl.config.resolve import resolve
from titanrl.data import load_eval_rows
from titanrl.models.hf_checkpoint import INDEX_FILE, SINGLE_FILE
from titanrl.rewards.scoring import is_correct
from titanrl.rundir.checkpoints import MANIFEST


@dataclass
class EvalReport:
    """What `titanrl eval` measured."""

    checkpoint: str
    """The CHECKPOINT argument as given."""
    prompts: int
    """Eval rows scored (the first eval.max_prompts of the eval file)."""
    accuracy: float
    """Fraction of prompts whose greedy completion's reward is >= eval.correct_threshold."""
    reward_mean: float
    """Mean reward of the greedy completions."""
    k: int | None = None
    """The k of pass@k; None when not asked for."""
    samples: int | None = None
    """Completions sampled per prompt for pass@k (n >= k)."""
    pass_at_k: float | None = None
    """Unbiased pass@k estimate, averaged over prompts."""
    sample_accuracy: float | None = None
    """Fraction of all sampled completions that pass (pass@1 at the sampling temperature)."""
    reward_errors: int = 0
    """Completions (greedy and sampled) whose reward function failed; they count as not passing."""

    def json_line(self) -> str:
        return json.dumps({
            "checkpoint": self.checkpoint, "accuracy": self.accuracy, "pass@k": self.pass_at_k, "k": self.k,
            "prompts": self.prompts, "samples": self.samples, "reward_mean": self.reward_mean,
            "sample_accuracy": self.sample_accuracy, "reward_errors": self.reward_errors,
        })

    def table(self, temperature: float, threshold: float) -> str:
        rows = [
            ("checkpoint", self.checkpoint),
            ("prompts", str(self.prompts)),
            (f"greedy accuracy (reward >= {threshold:g})", f"{self.accuracy:.1%}"),
            ("greedy reward mean", f"{self.reward_mean:.4f}"),
        ]
        if self.k is not None:
            rows.append((f"pass@{self.k} ({self.samples} samples/prompt, T={temperature:g})", f"{self.pass_at_k:.1%}"))
            rows.append(("sampled completions passing", f"{self.sample_accuracy:.1%}"))
        if self.reward_errors:
            rows.append(("reward errors (scored as failing)", str(self.reward_errors)))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file())


def resolve_hf_checkpoint(checkpoint: str | os.PathLike, scratch_dir: str | os.PathLike) -> Path:
    """An HF directory for CHECKPOINT: itself if it is one; a training checkpoint
    (`RUN/checkpoints/step_N` or its `trainer/`) or a run directory (its newest policy) is
    exported into `scratch_dir` first."""
    from titanrl.trainer.checkpoint import is_training_checkpoint

    path = Path(checkpoint)
    if not path.exists():
        raise CommandError(f"checkpoint {str(path)!r} does not exist")
    scratch = Path(scratch_dir) / "hf"
    if _is_hf_dir(path):
        return path
    if (path / MANIFEST).is_file() and is_training_checkpoint(path / "trainer"):
        return write_hf(path / "trainer", False, scratch)
    if is_training_checkpoint(path):
        return write_hf(path, False, scratch)
    if (path / "checkpoints").is_dir() or (path / "final").is_dir():
        policy = find_run_policy(path)
        return policy.path if policy.is_hf else write_hf(policy.path, False, scratch)
    raise CommandError(
        f"{str(path)!r} is not an HF checkpoint directory (config.json + {SINGLE_FILE}), a training "
        "checkpoint (RUN_DIR/checkpoints/step_N) or a run directory"
    )


def _validated(config: RunConfig, hf_dir: Path) -> RunConfig:
    """The config on `hf_dir`, checked; eval needs no train file, so an empty one is not an error."""
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, checkpoint=str(hf_dir)))
    data = config.data
    if not data.train_file and data.train_rows is None:
        data = dataclasses.replace(data, train_file=data.eval_file, train_rows=data.eval_rows)
    validate(dataclasses.replace(config, data=data))
    return config


def _make_worker(config: RunConfig, rollout: Any) -> Any:
    from titanrl.rollout.worker import RolloutWorker

    return RolloutWorker(0, resolve(dataclasses.replace(config, rollout=rollout)))


def evaluate_checkpoint(
    config: RunConfig, checkpoint: str | os.PathLike, k: int | None = None, samples: int | None = None
) -> EvalReport:
    """Greedy accuracy over the config's eval rows; with `k`, pass@k from `samples` (default k)
    completions per prompt at rollout.sampling.temperature, seeded by config.seed."""
    if not config.data.eval_file and config.data.eval_rows is None:
        raise CommandError(
            "the config has no data.eval_file (nor data.eval_rows): eval scores held-out rows; set it in "
            "the config file or pass --data.eval_file=FILE.jsonl"
        )
    if k is not None and k < 1:
        raise CommandError(f"--k must be >= 1, got {k}")
    if samples is not None and k is None:
        raise CommandError("--samples sets how many completions pass@k draws per prompt: pass --k K with it")
    n = samples if samples is not None else k
    if n is not None and k is not None and n < k:
        raise CommandError(f"--samples ({n}) must be >= --k ({k}): pass@k picks k of the n samples")
    from titanrl.rollout.seeds import request_seed

    with tempfile.TemporaryDirectory(prefix="titanrl-eval-") as scratch:
        hf_dir = resolve_hf_checkpoint(checkpoint, scratch)
        config = _validated(config, hf_dir)
        rc, ec = config.rollout, config.eval
        max_tokens = ec.max_new_tokens or rc.sampling.max_new_tokens
        rows = load_eval_rows(config)
        # The worker samples `group_size` completions per row: n of them, as long as eval's.
        rollout = dataclasses.replace(rc, group_size=n or 1,
                                      sampling=dataclasses.replace(rc.sampling, max_new_tokens=max_tokens))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        worker = _make_worker(config, rollout)
        try:
            greedy = worker.evaluate(rows, max_tokens, ec.correct_threshold)
            report = EvalReport(
                checkpoint=str(checkpoint),
                prompts=len(rows),
                accuracy=greedy["correct"] / len(rows),
                reward_mean=sum(greedy["rewards"]) / len(rows),
                reward_errors=greedy.get("reward_errors", 0),
            )
            if k is not None and n is not None:
                # Seeded as a run with seed config.seed seeds its first request.
                turns = config.calls_per_episode
                batch = worker.generate(rows, request_seed(config.seed, 0, n, turns), 0)
                passing = [sum(is_correct(s.reward, s.reward_error, ec.correct_threshold) for s in g.samples)
                           for g in batch.groups]
                report.reward_errors += sum(s.reward_error is not None for g in batch.groups for s in g.samples)
                report.k, report.samples = k, n
                report.pass_at_k = sum(pass_at_k(n, c, k) for c in passing) / len(rows)
                report.sample_accuracy = sum(passing) / (n * len(rows))
        finally:
            worker.close()
    return report
