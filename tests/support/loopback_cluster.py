"""A real three-node Ray cluster on this machine: `ray.cluster_utils.Cluster`, one raylet and object
store per node, each node on its own loopback address (127.0.0.1 head, 127.0.0.2, 127.0.0.3; Linux
routes all of 127/8 to `lo`), so where an actor runs shows in its node's address and nothing
leaves the machine.

Nodes carry the custom resources a run's `cluster.trainer_resource` / `cluster.worker_resource`
name: the head and node 3 take rollout workers, node 2 the trainer. Use it in a process of its
own (joining it replaces whatever Ray the process was connected to), with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment before Ray is imported (or Ray swaps the
loopback head address for the host's routable one).
"""

from __future__ import annotations

import os
from typing import Any

TRAINER, ROLLOUT = "titanrl_trainer", "titanrl_rollout"
NODE_ARGS = dict(num_cpus=1, include_dashboard=False, object_store_memory=150 << 20)
"""Each node: 1 CPU (the run reserves tokens), a 150 MiB object store."""
HEALTH_CHECKS = dict(health_check_period_ms=1000, health_check_failure_threshold=3)
"""The GCS's raylet health checks (cluster-wide, set on the head): a killed raylet refuses the
check at once, so a lost node is marked dead after ~3 s instead of Ray's default 5 x 3 s. A live
but busy raylet still has the default 10 s per check to answer."""


class LoopbackCluster:
    """Head 127.0.0.1 (1 rollout slot), node 2 at 127.0.0.2 (the trainer), node 3 at 127.0.0.3 (1 rollout slot)."""

    def __init__(self) -> None:
        if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
            raise RuntimeError("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray is imported")
        from ray.cluster_utils import Cluster

        # shutdown_at_exit=False: nodes start without installing signal handlers, so a test can add
        # one from a thread while the run holds the main thread (`shutdown` stops them all).
        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=False, head_node_args=dict(
            node_ip_address="127.0.0.1", resources={ROLLOUT: 1}, _system_config=HEALTH_CHECKS, **NODE_ARGS))
        self.trainer_node = self.add("127.0.0.2", {TRAINER: 1})
        self.rollout_node = self.add("127.0.0.3", {ROLLOUT: 1})

    def add(self, ip: str, resources: dict[str, float]) -> Any:
        """A new node at `ip` with `resources`, once it has joined (as a machine added mid-run)."""
        node = self.cluster.add_node(node_ip_address=ip, resources=resources, **NODE_ARGS)
        self.cluster.wait_for_nodes()
        return node

    @property
    def address(self) -> str:
        return self.cluster.address

    def remove(self, node: Any) -> None:
        """Kills the node's raylet and everything on it, as a lost machine."""
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()
