"""Runs on a real multi-node Ray cluster (tests/support/loopback_cluster.py: three raylets with their
own object stores, on 127.0.0.1-3), joined by address as `ray start --head` elsewhere would be.

The scenarios run one after another on one cluster, in a subprocess (this file as a script):
joining the cluster replaces the Ray this process is connected to, and the session's
`ray_session` must outlive these tests. The subprocess writes what it saw as JSON; the assertions
are made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic" / "config.py"
pytestmark = pytest.mark.multinode


def _scenario(name: str, tmp_path: Path, timeout_s: int = 420) -> dict:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, name, str(out), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory):
    """One three-node cluster for every scenario, in one subprocess (a cluster and the subprocess's
    imports cost ~15 s): the lock-step runs, then the elastic one on the nodes they leave."""
    return _scenario("all", tmp_path_factory.mktemp("multinode"), timeout_s=1500)


def test_arithmetic_run_with_the_trainer_on_one_node_and_workers_on_two_others(cluster_runs):
    """The arithmetic example for 3 lock-step steps (batch-invariant) on the 3-node cluster, joined
    by address: the trainer lands on node 2 (127.0.0.2) and one rollout worker on each of the other
    two nodes, by the nodes' custom resources; weights cross nodes through the object store and by
    a gloo broadcast whose store listens on the trainer's node (127.0.0.2, not loopback's .1);
    every step trains, to the same metrics. (The broadcast run is the one that loses the trainer's
    node below: placed and planned before the loss, the same metrics after its resume, whose new
    group listens on the trainer's new node, 127.0.0.5.)
    shared_memory is refused before any actor starts, naming the transports that work, and a
    resource no node has is refused naming it."""
    seen = cluster_runs
    for transport in ("object_store", "broadcast"):
        run = seen[transport]
        assert run["steps"] == [1, 2, 3], run
        assert "[127.0.0.2], 2 rollout worker(s) (cpu) on 2 node(s) [127.0.0.1, 127.0.0.3]" in run["placed"]
        assert all(s > 0 for s in run["weight_sync_s"])
    assert seen["broadcast"]["plan_host"] == "127.0.0.2"
    assert seen["broadcast"]["plan_hosts"] == ["127.0.0.2", "127.0.0.5"]  # the resumed attempt's trainer node too
    assert seen["broadcast"]["columns"] == seen["object_store"]["columns"]
    assert seen["shared_memory"]["type"] == "ConfigError"
    assert "'object_store' or 'broadcast'" in seen["shared_memory"]["error"]
    assert seen["missing_resource"]["type"] == "ConfigError"
    assert "custom resource 'titanrl_gpu_box'" in seen["missing_resource"]["error"]
    print(json.dumps({t: seen[t]["weight_sync_s"] for t in ("object_store", "broadcast")}))


def test_a_run_without_an_address_starts_its_own_ray_beside_a_cluster(cluster_runs):
    """With a cluster running on this machine (as `ray start` leaves one), a run without
    --ray_address still starts a Ray of its own rather than joining that one."""
    own = cluster_runs["own_ray"]
    assert own["rc"] == 0, own["stderr"]
    assert own["gcs"] and own["gcs"] != own["cluster"], own


def test_losing_a_rollout_workers_node_mid_run_is_survived(cluster_runs):
    """Node 3 (one of the two rollout workers) is removed after step 1 (its raylet killed, as a
    lost machine), and once Ray has marked it dead a fresh node with a rollout slot joins: the dead
    worker is replaced once, on the new node, the broadcast group re-forms with it, the run finishes
    every step, and (batch-invariant lock-step) its metrics equal the undisturbed object_store run's
    bit for bit. No step waits out the group's 300 s timeout (in CI the trainer once waited 300 s on
    a survivor that had given up on a push; tests/test_broadcast_member_loss.py pins that case)."""
    from titanrl.weight_sync.plan import WeightSyncPlan

    lost = cluster_runs["rollout_node_lost"]
    assert lost["steps"] == [1, 2, 3], lost
    assert lost["restarts"] == 1.0, lost
    assert max(lost["step_s"]) < WeightSyncPlan.timeout_s, lost["step_s"]
    assert lost.get("removed_after_step") == 1, lost  # the node was lost while the run was under way
    assert lost["columns"] == cluster_runs["object_store"]["columns"]
    print(json.dumps({k: v for k, v in lost.items() if k != "columns"}))


def test_losing_the_trainers_node_resumes_by_itself_with_auto_resume(cluster_runs):
    """The trainer's node is lost after step 1 is saved and a new node for it joins: with
    train.auto_resume the driver resumes from step 1's checkpoint by itself, and the finished run's
    metrics equal the undisturbed (object_store) run's bit for bit (batch-invariant). This run pushes
    by broadcast: its group dies with the trainer and the resumed attempt opens a new one."""
    lost = cluster_runs["trainer_lost"]
    assert lost["resumed_from_step"] == 1 and lost["removed_after_step"] >= 1
    assert lost["columns"] == cluster_runs["object_store"]["columns"]
    print(json.dumps({k: v for k, v in lost.items() if k != "columns"}))


def test_rollout_workers_grow_and_shrink_with_the_cluster(cluster_runs):
    """rollout.elastic on the 3-node cluster as the lock-step scenarios left it (continuous, 2 workers
    to start: the head's and the rollout node's that replaced node 3): a node with a rollout slot
    joins after step 1 and a third worker starts there, loads the current version and takes groups,
    without a restart; then the other rollout node is lost and its worker is dropped (not replaced:
    workers/restarts stays 0), its groups finishing on the others. rollout/workers shows
    2 -> 3 -> 2, and the run goes on after each change."""
    seen = cluster_runs["elastic"]
    assert "error" not in seen, seen["error"]
    workers = seen["workers"]
    assert workers[0] == 2 and 3 in workers and workers[-1] == 2, seen
    first_three, last_two = workers.index(3), len(workers) - 1 - workers[::-1].index(3)
    assert first_three >= seen["added_after_step"] and last_two + 1 < len(workers), seen
    assert seen["steps"] == list(range(1, len(workers) + 1))
    assert seen["restarts"] == 0, seen
    joined, up, lost = seen["log"]
    assert "a node joined" in joined and "is up" in up and "node is lost" in lost, seen["log"]
    print(json.dumps({k: seen[k] for k in ("workers", "step_s", "added_after_step", "up_after_step",
                                           "dropped_after_step", "dropped_after_s")}))


# --- the scenarios (run in a subprocess) ---------------------------------------------------------
def _config(tmp: Path, name: str, address: str, **rollout):
    from titanrl.cli import load_config_file

    config = load_config_file(str(EXAMPLE))
    config.ray_address = address
    config.cluster.trainer_resource, config.cluster.worker_resource = "titanrl_trainer", "titanrl_rollout"
    config.rollout.num_workers = 2
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    config.train.steps, config.train.max_staleness = 3, 0
    config.eval.every_steps = 0
    config.output.dir, config.output.progress_bar, config.output.save_every_steps = str(tmp / name), False, 1
    config.batch_invariant = True
    return config


def _columns(metrics: list[dict]) -> list[list]:
    return [[m["step"], m["loss"], m["reward/mean"], m["grad_norm"]] for m in metrics if m["step"] > 0]


class _Log(list):
    """The titanrl logger's messages."""

    def __init__(self) -> None:
        import logging

        super().__init__()
        handler = logging.Handler()
        handler.emit = lambda record: self.append(record.getMessage())
        logger = logging.getLogger("titanrl")
        logger.addHandler(handler)  # the application's handler: train() then adds none of its own
        logger.setLevel(logging.INFO)


def _all(out: Path, tmp: Path) -> None:
    """The lock-step scenarios, then the elastic one, on one cluster; `out` gets what each saw."""
    from support.loopback_cluster import LoopbackCluster

    log, seen = _Log(), {}
    cluster = LoopbackCluster()
    try:
        _lock_step(cluster, tmp, log, seen)
        seen["elastic"] = {}
        try:
            _elastic(cluster, tmp, log, seen["elastic"])
        except Exception:  # the elastic test reports it; the lock-step tests stand on their own
            seen["elastic"]["error"] = traceback.format_exc()
    finally:
        out.write_text(json.dumps(seen))
        import ray

        ray.shutdown()
        cluster.shutdown()


def _lock_step(cluster, tmp: Path, log: list, seen: dict) -> None:
    import titanrl

    log.clear()
    seen["object_store"] = _transport_run(
        titanrl.train(_config(tmp, "object_store", cluster.address, weight_transport="object_store")), log)
    for name, change in (("shared_memory", dict(weight_transport="shared_memory")), ("missing_resource", {})):
        config = _config(tmp, name, cluster.address, **change)
        if name == "missing_resource":
            config.cluster.worker_resource = "titanrl_gpu_box"
        try:
            titanrl.train(config)
            seen[name] = dict(type=None, error="it ran")
        except Exception as e:  # noqa: BLE001 - what was raised is the result
            seen[name] = dict(type=type(e).__name__, error=str(e))
    seen["own_ray"] = _own_ray_beside(cluster)
    seen["trainer_lost"] = _lose_the_trainers_node(cluster, tmp, log)
    # the broadcast run is the trainer-loss run: its first attempt's placement and plan are
    # logged before the node is lost, its steps and metrics are those of the resumed run
    seen["broadcast"] = _transport_run(seen["trainer_lost"].pop("result"), log)
    seen["rollout_node_lost"] = _lose_a_rollout_node(cluster, tmp)


def _transport_run(result, log: list) -> dict:
    """What a finished run's weight transport did: steps, per-step sync seconds, metrics, where
    the actors were placed and the host broadcast's group store listened on (None without one)."""
    steps = [m for m in result.metrics if m["step"] > 0]
    hosts = [m.split(" from ")[1].split(":")[0] if " from " in m else None for m in log if m.startswith("actors ready")]
    return dict(steps=[m["step"] for m in steps], weight_sync_s=[m["time/weight_sync_s"] for m in steps],
                columns=_columns(result.metrics), placed=next(m for m in log if m.startswith("placed ")),
                plan_host=hosts[0], plan_hosts=hosts)


def _lose_the_trainers_node(cluster, tmp: Path, log: list) -> dict:
    """The run again with weight_transport='broadcast' and train.auto_resume; node 2 (the trainer's)
    is removed once step 1 is saved, and a new node with the trainer's resource joins 5 s later.
    `result` is the resumed run's RunResult."""
    import titanrl
    from support.loopback_cluster import TRAINER

    config = _config(tmp, "trainer_lost", cluster.address, weight_transport="broadcast")
    config.train.auto_resume = True
    seen: dict = {}

    def lose_it() -> None:
        while not (tmp / "trainer_lost" / "checkpoints" / "step_000001").is_dir():
            time.sleep(0.1)
        seen["removed_after_step"] = _steps_done(tmp / "trainer_lost")
        t0 = time.perf_counter()
        cluster.remove(cluster.trainer_node)
        time.sleep(5)
        cluster.trainer_node = cluster.add("127.0.0.5", {TRAINER: 1})
        seen["node_joined_after_s"] = time.perf_counter() - t0
        seen["removed_at"] = time.time()

    threading.Thread(target=lose_it, daemon=True).start()
    log.clear()
    result = titanrl.train(config)
    resumed = [m for m in log if "train.auto_resume: resuming from step" in m]
    seen.update(columns=_columns(result.metrics), resumed=resumed, result=result,
                resumed_from_step=int(resumed[0].split("resuming from step ")[1].split()[0]) if resumed else None,
                finished_after_removal_s=time.time() - seen["removed_at"])
    return seen


def _steps_done(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _own_ray_beside(cluster) -> dict:
    """What `init_ray()` without an address joins in a fresh process while this cluster runs."""
    code = ("from titanrl.driver.ray_runtime import init_ray; init_ray(num_cpus=1); import ray; "
            "print(ray.get_runtime_context().gcs_address); ray.shutdown()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return dict(rc=proc.returncode, gcs=proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else None,
                cluster=cluster.address, stderr=proc.stderr[-2000:])


def _lose_a_rollout_node(cluster, tmp: Path) -> dict:
    """The run again with weight_transport='broadcast' (its group re-forms with the replacement).
    Node 3 (a rollout worker's) is lost at a fixed point, so the run cannot finish before it: while
    the driver logs step 1 (step 2's generation and the push of version 1 already sent to the
    workers), the node is removed, the driver waits until Ray's health checks mark it dead, and a
    new node with a rollout slot joins; then the run goes on and meets the dead worker. (Lost from
    a thread instead, CI once finished steps 2 and 3 before the node was gone: restarts 0.)"""
    import ray

    import titanrl
    from support.loopback_cluster import ROLLOUT
    from titanrl.rundir.metrics import MetricsLogger

    seen: dict = {}
    log_step = MetricsLogger.log

    def lose_the_node_after_step_1(logger, record) -> None:
        log_step(logger, record)
        if record["step"] != 1:
            return
        seen["removed_after_step"] = 1
        lost_ip, t0 = cluster.rollout_node.node_ip_address, time.perf_counter()
        cluster.remove(cluster.rollout_node)
        while any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == lost_ip):
            if time.perf_counter() - t0 > 60:
                raise TimeoutError(f"Ray did not mark the node at {lost_ip} dead within 60 s")
            time.sleep(0.2)
        seen["marked_dead_after_s"] = time.perf_counter() - t0
        cluster.rollout_node = cluster.add("127.0.0.4", {ROLLOUT: 1})

    MetricsLogger.log = lose_the_node_after_step_1
    try:
        result = titanrl.train(_config(tmp, "rollout_node_lost", cluster.address, weight_transport="broadcast"))
    finally:
        MetricsLogger.log = log_step
    steps = [m for m in result.metrics if m["step"] > 0]
    seen.update(steps=[m["step"] for m in steps], restarts=steps[-1]["workers/restarts"],
                step_s=[m["time/step_s"] for m in steps], columns=_columns(result.metrics))
    return seen


def _elastic(cluster, tmp: Path, log: list, seen: dict) -> None:
    """A continuous elastic run with 2 workers (head, the rollout node: node 4 after the lock-step
    scenarios): node 6 joins after step 1; once its worker is up and takes groups, the rollout node
    is lost; two steps after its worker was dropped the run is interrupted (Ctrl-C, saved): a new
    engine's start-up beside a running one takes 20-60 s on 2 cores, so the steps it needs are not
    known in advance."""
    import _thread

    import titanrl
    from support.loopback_cluster import ROLLOUT
    from titanrl.rundir.metrics import read_metrics

    config = _config(tmp, "elastic", cluster.address, weight_transport="object_store", num_workers=2,
                     continuous=True, elastic=True)
    config.train.steps = 500
    run_dir = tmp / "elastic"
    log.clear()

    def wait_for(message: str) -> None:
        while not any(message in m for m in log):
            time.sleep(0.2)

    def change_the_cluster() -> None:
        while _steps_done(run_dir) < 1:
            time.sleep(0.2)
        cluster.add("127.0.0.6", {ROLLOUT: 1})
        seen["added_after_step"] = _steps_done(run_dir)
        wait_for("is up")
        seen["up_after_step"] = _steps_done(run_dir)
        seen["removed_at"] = time.time()
        cluster.remove(cluster.rollout_node)
        wait_for("node is lost")
        seen["dropped_after_s"] = time.time() - seen["removed_at"]
        seen["dropped_after_step"] = dropped = _steps_done(run_dir)
        while _steps_done(run_dir) < dropped + 2:
            time.sleep(0.2)
        _thread.interrupt_main()

    threading.Thread(target=change_the_cluster, daemon=True).start()
    try:
        titanrl.train(config)
    except KeyboardInterrupt:
        pass
    steps = [m for m in read_metrics(run_dir) if m["step"] > 0]
    seen.update(steps=[m["step"] for m in steps], workers=[m["rollout/workers"] for m in steps],
                restarts=steps[-1]["workers/restarts"], step_s=[m["time/step_s"] for m in steps],
                log=[m for m in log if m.startswith("rollout.elastic")])


if __name__ == "__main__":
    scenario, out_file, tmp_dir = sys.argv[1:4]
    {"all": _all}[scenario](Path(out_file), Path(tmp_dir))
