"""Every benchmark runs: each script in benchmarks/ with `--smoke` (tiny sizes, the real run's code path).

Benchmarks run for minutes and import most things after parsing their arguments, so one broken
by a change elsewhere (a renamed config field, a new signature) shows only when someone next
measures with it. Each `benchmarks/*.py` and `benchmarks/*.sh` runs here as a subprocess from
the repository root with `--smoke`; a new script without that mode fails. A run must exit 0,
print at least one JSON object line, print no line with an "error" key (several scripts report
a failed arm that way and go on), write nothing under benchmarks/results/, and pass its own
check below where one is cheap.

The scripts are slow to start (a vLLM engine ~15 s, a Ray run's actors ~20 s per run), so they
run two at a time in the background, longest first, never two that start Ray at once (each starts
several processes): the 2-core machine this was sized on runs two such scripts side by side at
~1.2x their time alone (each mostly uses one thread), with Ray's actors at normal priority (Ray's
own nice 15 starves them beside another script). A test waits for its script, so pytest's
--durations shows waits; each test prints its script's own seconds (`pytest -s`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
SCRIPTS = sorted([*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("*.sh")])
TIMEOUT_S = 600
"""Per script; a smoke run takes seconds to about a minute here (AVX2 machines run this suite 2-3x slower)."""
RAY_SCRIPTS = {"async_speedup.py", "continuous_vs_lockstep.py", "vs_trl.py", "weight_sync.py", "actor_memory.py"}
"""Scripts that start a Ray instance (titanrl.train or actors of their own): one at a time."""
SECONDS_ALONE = {
    "async_speedup.py": 61, "continuous_vs_lockstep.py": 57, "lora.py": 56, "vs_trl.py": 42, "weight_sync.py": 40,
    "actor_memory.py": 39, "moe_replay.py": 28, "prefill_sharing.py": 27, "gpu_trainer_check.sh": 24,
    "rollout_engine.py": 22, "batch_invariance.py": 22, "moe_step.py": 20, "agent_endpoint.py": 18,
    "request_options.py": 16, "trainer_memory.py": 13, "engine_thread.py": 12, "chunked_logprobs.py": 11,
    "heap_threshold.py": 10, "parallel_layouts.py": 9, "gpu_kernels_check.py": 7, "trainer_step.py": 5,
    "gpu_model_check.py": 3, "shm_page_release.py": 3, "sandbox_pool.py": 1,
}
"""Seconds of each smoke run here, two at a time, on the 2-core AMD EPYC (AVX-512): only the order
they start in (longest first, so neither thread ends with a long one; a script not listed counts as 30)."""
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


@dataclass
class Run:
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    results_changed: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def records(self) -> list[dict[str, Any]]:
        """The stdout lines that are JSON objects."""
        out = []
        for line in self.stdout.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict) and value:
                out.append(value)
        return out

    def tail(self) -> str:
        return f"--- stdout (end) ---\n{self.stdout[-3000:]}\n--- stderr (end) ---\n{self.stderr[-5000:]}"


def _results_state() -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(RESULTS)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in RESULTS.rglob("*") if p.is_file()}


def _run(script: Path, run: Run) -> None:
    command = ["bash" if script.suffix == ".sh" else sys.executable, str(script), "--smoke"]
    # RAY_ADDRESS=local: a Ray of its own, whatever else runs on the machine. RAY_worker_niceness=0:
    # Ray starts its actors at nice 15, where a script beside them starves their start-up (~4x longer).
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", RAY_ADDRESS="local",
               RAY_worker_niceness="0")
    before = _results_state()
    start = time.perf_counter()
    try:
        # A session of its own, so that a run past the timeout goes with everything it started.
        with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            try:
                run.stdout, run.stderr = proc.communicate(timeout=TIMEOUT_S)
                run.returncode = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                run.stdout, run.stderr = proc.communicate()
                run.returncode, run.stderr = -1, f"timed out after {TIMEOUT_S} s\n{run.stderr}"
    finally:
        run.seconds = time.perf_counter() - start
        after = _results_state()
        run.results_changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        run.done.set()


class SmokeRuns:
    """Runs the selected scripts in the background, two at a time, longest first: each of two
    threads takes the longest script left whenever it is free, except a script that starts Ray
    while another one runs (then the longest other script). Both threads stay busy to the end
    (fixed queues of Ray / other scripts left the longer one running alone for 1-2 minutes)."""

    def __init__(self, scripts: list[Path]) -> None:
        self.runs = {s.name: Run() for s in scripts}
        self.pending = sorted(scripts, key=lambda s: -SECONDS_ALONE.get(s.name, 30))  # longest first
        self.ray_running = False
        self.changed = threading.Condition()
        for i in range(2):  # not daemons: an early exit still waits for the scripts, as for any queued run
            threading.Thread(target=self._work, name=f"smoke-{i}").start()

    def _next(self) -> Path | None:
        """The longest pending script this thread may start now (waits while only Ray scripts are
        left and one runs); None when none is left."""
        with self.changed:
            while True:
                allowed = [s for s in self.pending if not (self.ray_running and s.name in RAY_SCRIPTS)]
                if allowed:
                    self.pending.remove(allowed[0])
                    self.ray_running |= allowed[0].name in RAY_SCRIPTS
                    return allowed[0]
                if not self.pending:
                    return None
                self.changed.wait()

    def _work(self) -> None:
        while (script := self._next()) is not None:
            try:
                _run(script, self.runs[script.name])
            finally:
                with self.changed:
                    if script.name in RAY_SCRIPTS:
                        self.ray_running = False
                    self.changed.notify_all()

    def result(self, name: str) -> Run:
        run = self.runs[name]
        run.done.wait()
        return run


@pytest.fixture(scope="module")
def smoke_runs(request) -> SmokeRuns:
    """The runs of the scripts this session selected (all of them, or those `-k` leaves)."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "script" in item.callspec.params}
    return SmokeRuns([s for s in SCRIPTS if s in selected])


# --- what each script's output must say, beyond exit 0 and a JSON line -------------------------

def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return _finite(value) and value > 0


def _one(records: list[dict], **match: Any) -> dict:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"expected one line with {match}, found {len(found)}"
    return found[0]


def _summary(records: list[dict]) -> dict:
    return _one(records, summary=True)


def check_agent_endpoint(records: list[dict]) -> None:
    summary = _summary(records)
    # Every endpoint call sampled the tokens of the direct call with the same prompt ids and seed.
    assert summary["identical_tokens"] is True
    assert set(summary["ratio_median"]) == {"sequential_m1", "sequential_m32"}
    assert all(_positive(r) for arms in summary["ratio_median"].values() for r in arms.values())
    assert {arm for arms in summary["ratio_median"].values() for arm in arms} == {"completions", "chat"}
    assert all(map(_positive, summary["concurrent_wall_ratio"].values())) and summary["concurrent_wall_ratio"]


def check_async_speedup(records: list[dict]) -> None:
    runs = {r["run"]: r for r in records if "run" in r}
    assert set(runs) == {"sync", "async"}  # --smoke leaves out lockstep_stale
    assert runs["sync"]["staleness_max"] == 0  # on-policy; the async run's depends on timing
    assert _positive(_one(records, benchmark="async_speedup")["speedup"])


def check_batch_invariance(records: list[dict]) -> None:
    line = _one(records, benchmark="batch_invariance")
    assert _positive(line["gen_ratio"]) and _positive(line["train_ratio"])


def check_chunked_logprobs(records: list[dict]) -> None:
    summary = _summary(records)
    assert summary["chunked_logprobs_peak_ratio"] and all(map(_positive, summary["chunked_logprobs_peak_ratio"].values()))
    assert summary["truncated_time_ratio"] and all(map(_positive, summary["truncated_time_ratio"].values()))


def check_continuous_vs_lockstep(records: list[dict]) -> None:
    line = _one(records, benchmark="continuous_vs_lockstep")
    assert _positive(line["step_ratio"]) and _positive(line["gen_tok_s_ratio"])
    assert all(r["steps"] == 2 for r in records if "run" in r)


def check_engine_thread(records: list[dict]) -> None:
    line = _one(records, benchmark="engine_thread")
    assert set(line["thread_over_main"]) == {"one_arena"}  # --smoke runs TitanRL's setting only
    assert all(map(_positive, line["thread_over_main"].values()))


def check_gpu_kernels_check(records: list[dict]) -> None:
    assert _one(records, name="summary")["failed_items"] == 0
    checks = [r for r in records if r["name"].startswith("check ")]
    assert len(checks) == 5 and all(r["ok"] is True for r in checks)  # linear, rms_norm, log_softmax, attention, gradients
    assert all(_positive(r["slowdown"]) for r in records if r["name"].startswith("time "))


def check_gpu_model_check(records: list[dict]) -> None:
    line = _one(records, name="demo_0.5m")
    assert line["invariant"] is True, "batch-invariant logprobs differ with the batch"
    assert line["grad_max_abs_diff"] < 1e-4 and _positive(line["train_ratio"])


def check_gpu_trainer_check(records: list[dict]) -> None:
    arms = [r for r in records if r.get("benchmark") == "trainer_step" and not r.get("summary")]
    assert {r["layout"] for r in arms} == {"padded", "packed", "shared"}
    assert any(r["compile"] for r in arms), "the compiled arm did not run"
    assert all(_positive(r["step_s"]) for r in arms)


def check_heap_threshold(records: list[dict]) -> None:
    rows = [r for r in records if "threshold_mib" in r]
    assert [r["threshold_mib"] for r in rows] == [4, 0] and all(_positive(r["step_s"]) for r in rows)




def check_moe_replay(records: list[dict]) -> None:
    cases = {r["case"]: r for r in records}
    assert cases["same_weights"]["route_agreement"] == 1.0, "the trainer routes unlike the generator at equal weights"
    replayed = [r for name, r in cases.items() if name.endswith("_replay")]
    assert replayed and all(r["used_agreement"] == 1.0 for r in replayed)




def check_moe_step(records: list[dict]) -> None:
    arms = [r for r in records if "arm" in r]
    assert {r["ep"] for r in arms} == {1, 2} and {r["experts"] for r in arms} == {"grouped_mm", "loop"}
    assert all(_positive(r["tokens_per_s"]) for r in arms)


def check_parallel_layouts(records: list[dict]) -> None:
    summary = _one(records, smoke=True)
    assert summary["ok"] is True, f"a layout differs from one process by {summary['max_loss_or_grad_rel_diff']}"


def check_prefill_sharing(records: list[dict]) -> None:
    summary = _summary(records)
    assert _positive(summary["prefill_speedup_32"]) and _positive(summary["rollout_speedup_32"])


def check_request_options(records: list[dict]) -> None:
    line = _one(records, benchmark="request_options")
    assert line["identical_tokens"] and line["identical_texts"] and line["max_logprob_diff"] == 0.0
    assert _positive(line["titanrl_over_baseline"])


def check_rollout_engine(records: list[dict]) -> None:
    (workload,) = _one(records, benchmark="rollout_engine")["sizes"]["tiny"]["generation"].values()
    assert workload["same_tokens_fraction"] == 1.0, "our model sampled other tokens than vLLM's"
    assert _positive(workload["ratio_ours_over_builtin"])


def check_sandbox_pool(records: list[dict]) -> None:
    line = _one(records, benchmark="sandbox_pool")
    assert _positive(line["latency"]["ratio_one_shot_over_pool_median"])
    assert _positive(line["throughput"]["ratio_pool_over_one_shot"])


def check_actor_memory(records: list[dict]) -> None:
    arm = _one(records, arm="smoke")
    # The plan chose every memory setting, and both actors' estimates are near what they measured.
    assert set(arm["chosen"]) == {"train.memory.activation_checkpointing", "train.memory.micro_batch_size",
                                  "rollout.engine.vllm_kernels", "rollout.engine.kv_cache_gib"}
    assert 0.5 < arm["trainer_ratio"] < 2 and 0.5 < arm["worker_ratio"] < 2
    assert _summary(records)["failed"] == 0


def check_trainer_memory(records: list[dict]) -> None:
    arms = [r for r in records if "arm" in r]
    assert len(arms) == 3 and all(r["peak_rss_bytes"] > 0 for r in arms)
    assert _positive(_summary(records)["chunked_logprobs_peak_ratio"])


def check_trainer_step(records: list[dict]) -> None:
    arms = [r for r in records if r.get("benchmark") == "trainer_step" and not r.get("summary")]
    assert len(arms) == 12 and all(_positive(r["step_s"]) for r in arms)  # 2 dtypes x invariance off/on x 3 layouts
    assert _summary(records)["real_tokens"] > 0


def check_vs_trl(records: list[dict]) -> None:
    titanrl = _one(records, arm="titanrl")
    assert _positive(titanrl["step_s"]) and titanrl["measured_steps"] == 1
    if TRL_PYTHON.is_file():  # then the TRL arm ran, and the summary compares
        assert _positive(_summary(records)["ratio_titanrl_over_trl_speed"])
    else:
        notes = [r["trl_arm"] for r in records if "trl_arm" in r]
        assert len(notes) == 1 and notes[0].startswith("not run"), notes


def check_weight_sync(records: list[dict]) -> None:
    summary = _one(records, summary="weight_sync")
    assert {"object_store", "shared_memory", "broadcast", "gloo_floor"} <= {k.split("/")[0] for k in summary["ratios"]}
    assert all(map(_positive, summary["ratios"].values()))


def check_shm_page_release(records: list[dict]) -> None:
    summary = _summary(records)
    assert _positive(summary["release_over_keep"])
    # Without the release the sender keeps the pushed segment resident; with it, much less.
    assert min(summary["rss_growth_mib"]["keep"]) > max(summary["rss_growth_mib"]["release"])


CHECKS: dict[str, Callable[[list[dict]], None]] = {
    name.removeprefix("check_") + (".sh" if name == "check_gpu_trainer_check" else ".py"): fn
    for name, fn in globals().items() if name.startswith("check_")
}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_smoke(script: Path, smoke_runs: SmokeRuns) -> None:
    run = smoke_runs.result(script.name)
    print(f"\n{script.name}: {run.seconds:.1f} s")
    assert run.returncode == 0, f"{script.name} --smoke exited {run.returncode}\n{run.tail()}"
    records = run.records()
    assert records, f"{script.name} --smoke printed no JSON object line\n{run.tail()}"
    errors = [r for r in records if "error" in r]
    assert not errors, f"{script.name} --smoke reported errors: {errors}"
    assert not run.results_changed, f"benchmarks/results/ changed while {script.name} ran: {run.results_changed}"
    if script.name in CHECKS:
        CHECKS[script.name](records)


def test_every_check_names_a_script() -> None:
    assert set(CHECKS) <= {s.name for s in SCRIPTS}, f"checks of scripts that are gone: {set(CHECKS) - {s.name for s in SCRIPTS}}"
