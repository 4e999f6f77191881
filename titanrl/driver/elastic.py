"""Elastic rollout capacity (`rollout.elastic`): one more rollout worker for each node that joins
the Ray cluster mid-run, one fewer for each worker whose node is lost.

A continuous run (`titanrl.driver.sources.continuous`) asks `ElasticCapacity.new_homes` once per
step for the places where new workers can start: a bundle of the run's placement group whose
worker was dropped and that Ray has since placed on a live node again, and a group of one worker
bundle reserved for every node that joined since the last look (where the cluster has room for
one). A worker whose actor died is dropped instead of replaced when its node is gone
(`node_lost`); the groups it had not finished go to the others, and its bundle waits in `vacant`
for capacity. The last worker is never dropped: it is replaced as in a fixed-size run.
"""

from __future__ import annotations

import time

from titanrl.driver.placement import Placement, WorkerHome

RESERVE_TIMEOUT_S = 3.0
"""How long one look waits for a worker bundle on a joined node: Ray places a bundle that fits in
well under a second, and a step should not wait longer for a node that has no room."""

NODE_DEATH_WAIT_S = 20.0
"""How long a dead worker's slot waits for Ray to say whether its node died (the cluster's health
check marks a lost raylet dead after a few seconds) before it is replaced in place."""


class ElasticCapacity:
    """The cluster's nodes as an elastic run sees them, and the worker homes they make room for."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.known_nodes = self._alive_nodes()
        """The live nodes at the last look: a node not among them has joined since."""
        self.vacant: list[WorkerHome] = []
        """Bundles of the run's group whose worker was dropped; they take a worker again once live."""

    @staticmethod
    def _alive_nodes() -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def new_homes(self) -> list[WorkerHome]:
        """Where to start new workers now: vacant bundles Ray has placed on a live node, then one
        reserved bundle per node that joined since the last look (none where it has no room)."""
        homes = [home for home in self.vacant if self.placement.home_node(home) is not None]
        self.vacant = [home for home in self.vacant if home not in homes]
        nodes = self._alive_nodes()
        joined = nodes - self.known_nodes
        self.known_nodes = nodes
        for _ in range(max(0, len(joined) - len(homes))):
            home = self.placement.reserve_home(RESERVE_TIMEOUT_S)
            if home is None:
                break
            homes.append(home)
        return homes

    def _as_home(self, home: int | WorkerHome) -> WorkerHome:
        """A slot's home as the worker pool keeps it: the starting workers' are their indexes."""
        return self.placement.worker_home(home) if isinstance(home, int) else home

    def node_lost(self, home: int | WorkerHome, poll_s: float = 0.5) -> bool:
        """Whether the node under `home` died (its worker died with it), waiting up to
        `NODE_DEATH_WAIT_S` for Ray to notice; False when the node lives on (the worker itself died)."""
        home = self._as_home(home)
        node = self.placement.home_node(home)
        deadline = time.monotonic() + NODE_DEATH_WAIT_S
        while node is not None and time.monotonic() < deadline:
            if node not in self._alive_nodes():
                return True
            time.sleep(poll_s)
        return node is None

    def release(self, home: int | WorkerHome) -> None:
        """A dropped worker's home: a group of its own is given back; a bundle of the run's group
        waits in `vacant` (Ray places it again when a node has room)."""
        home = self._as_home(home)
        if home.own:
            self.placement.release_home(home)
        else:
            self.vacant.append(home)
        self.known_nodes = self._alive_nodes()  # the lost node is not a join to answer later

    def describe(self, home: WorkerHome) -> str:
        """The address of `home`'s node, for the log."""
        import ray

        node = self.placement.home_node(home)
        return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), "?")
