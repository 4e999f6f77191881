"""Runs on a real multi-node Ray cluster (tests/support/loopback_cluster.py: three raylets with their
own object stores, on 127.0.0.1-3), joined by address as `ray start --head` elsewhere would be.

Each scenario runs in a subprocess (this file as a script): joining the cluster replaces the Ray
this process is connected to, and the session's `ray_session` must outlive these tests. The
subprocess writes what it saw as JSON; the assertions are made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
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


def test_arithmetic_run_with_the_trainer_on_one_node_and_workers_on_two_others(tmp_path):
    """The arithmetic example for 3 lock-step steps on the 3-node cluster, joined by address: the
    trainer lands on node 2 (127.0.0.2) and one rollout worker on each of the other two nodes,
    by the nodes' custom resources; weights cross nodes through the object store and by a gloo
    broadcast whose store listens on the trainer's node (127.0.0.2, not loopback's .1); every
    step trains. shared_memory is refused before any actor starts, naming the transports that work."""
    seen = _scenario("transports", tmp_path)
    for transport in ("object_store", "broadcast"):
        run = seen[transport]
        assert run["steps"] == [1, 2, 3], run
        assert "[127.0.0.2], 2 rollout worker(s) (cpu) on 2 node(s) [127.0.0.1, 127.0.0.3]" in run["placed"]
        assert all(s > 0 for s in run["weight_sync_s"])
    assert seen["broadcast"]["plan_host"] == "127.0.0.2"
    assert seen["shared_memory"]["type"] == "ConfigError"
    assert "'object_store' or 'broadcast'" in seen["shared_memory"]["error"]
    assert seen["missing_resource"]["type"] == "ConfigError"
    assert "custom resource 'titanrl_gpu_box'" in seen["missing_resource"]["error"]
    print(json.dumps({t: seen[t]["weight_sync_s"] for t in ("object_store", "broadcast")}))


def test_losing_a_rollout_workers_node_mid_run_is_survived(tmp_path):
    """Node 3 (one of the two rollout workers) is removed after step 1 (its raylet killed, as a
    lost machine) and a fresh node with a rollout slot joins 5 s later: the dead worker is replaced
    on the new node and the run finishes every step. (workers/restarts is 1 or 2: until Ray's
    health checks mark the lost node dead, its bundle still points there, and a replacement started
    then dies at once and is replaced again.)"""
    seen = _scenario("node_loss", tmp_path)
    assert seen["steps"] == [1, 2, 3, 4], seen
    assert 1.0 <= seen["restarts"] <= 2.0
    assert seen["removed_after_step"] >= 1
    print(json.dumps(seen))


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
    config.output.dir, config.output.progress_bar, config.output.save_every_steps = str(tmp / name), False, 0
    return config


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


def _transports(out: Path, tmp: Path) -> None:
    import titanrl
    from support.loopback_cluster import LoopbackCluster
    log, seen = _Log(), {}
    cluster = LoopbackCluster()
    try:
        for transport in ("object_store", "broadcast"):
            log.clear()
            result = titanrl.train(_config(tmp, transport, cluster.address, weight_transport=transport))
            steps = [m for m in result.metrics if m["step"] > 0]
            ready = next(m for m in log if m.startswith("actors ready"))
            seen[transport] = dict(steps=[m["step"] for m in steps], weight_sync_s=[m["time/weight_sync_s"] for m in steps],
                                   placed=next(m for m in log if m.startswith("placed ")),
                                   plan_host=ready.split(" from ")[1].split(":")[0] if " from " in ready else None)
        for name, change in (("shared_memory", dict(weight_transport="shared_memory")), ("missing_resource", {})):
            config = _config(tmp, name, cluster.address, **change)
            if name == "missing_resource":
                config.cluster.worker_resource = "titanrl_gpu_box"
            try:
                titanrl.train(config)
                seen[name] = dict(type=None, error="it ran")
            except Exception as e:  # noqa: BLE001 - what was raised is the result
                seen[name] = dict(type=type(e).__name__, error=str(e))
    finally:
        out.write_text(json.dumps(seen))
        import ray

        ray.shutdown()
        cluster.shutdown()


def _steps_done(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _node_loss(out: Path, tmp: Path) -> None:
    import titanrl
    from support.loopback_cluster import ROLLOUT, LoopbackCluster

    seen: dict = {}
    cluster = LoopbackCluster()
    config = _config(tmp, "node_loss", cluster.address, weight_transport="object_store")
    config.train.steps = 4

    def lose_a_node() -> None:
        while _steps_done(tmp / "node_loss") < 1:
            time.sleep(0.2)
        seen["removed_after_step"] = _steps_done(tmp / "node_loss")
        t0 = time.perf_counter()
        cluster.remove(cluster.rollout_node)
        time.sleep(5)
        cluster.add("127.0.0.4", {ROLLOUT: 1})
        seen["node_joined_after_s"] = time.perf_counter() - t0

    watcher = threading.Thread(target=lose_a_node, daemon=True)
    watcher.start()
    try:
        result = titanrl.train(config)
        steps = [m for m in result.metrics if m["step"] > 0]
        seen.update(steps=[m["step"] for m in steps], restarts=steps[-1]["workers/restarts"],
                    step_s=[m["time/step_s"] for m in steps])
    finally:
        out.write_text(json.dumps(seen))
        import ray

        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    scenario, out_file, tmp_dir = sys.argv[1:4]
    {"transports": _transports, "node_loss": _node_loss}[scenario](Path(out_file), Path(tmp_dir))
