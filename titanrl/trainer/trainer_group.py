"""The parallel trainer as one Ray actor with GRPOTrainer's methods, owning one actor per rank.

Each rank is a `ParallelTrainerRank`: the `GRPOTrainer` itself, started with that rank's
torch.distributed environment (GRPOTrainer joins the world and shards the policy when
`train.parallel` asks for more than one process).

The driver starts `TrainerGroup` exactly as it starts `GRPOTrainer`
(`ray.remote(TrainerGroup).options(num_cpus=0).remote(setup, ...)`),
so the loop's `trainer.step.remote(groups)` etc. work unchanged. The group starts
`train.parallel.world_size` `ParallelTrainerRank` actors, which rendezvous with torch.distributed
on the Ray address of rank 0's node (127.0.0.1 when Ray runs on loopback) and a port free there,
forwards every call to all of them (collectives need every rank), and returns rank 0's answer.
The rank actors are owned by the group: killing the group ends them. Where they run is the
caller's choice (`rank_options`, e.g. `titanrl.placement.Placement`'s bundles); by default all
run on the group's own node.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

from titanrl.errors import ConfigError
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, PolicyVersion

RENDEZVOUS_TIMEOUT_S = 120.0
"""How long the group waits to learn rank 0's address (its bundle must be placed)."""


def rendezvous_point() -> tuple[str, int]:
    """(address, port) to rendezvous on this node: its address in Ray (127.0.0.1 for a loopback
    Ray, the node's own address in a cluster) and a port free on it. Call it where rank 0 runs."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def rank0_rendezvous_point(rank0_options: dict[str, Any]) -> tuple[str, int]:
    """`rendezvous_point()` of the node where an actor with `rank0_options` will run: asked by a
    zero-resource task scheduled by the same strategy (a placement group bundle, a node)."""
    import ray

    strategy = rank0_options.get("scheduling_strategy")
    if strategy is None or isinstance(strategy, str):
        raise ValueError("rank_options must pin rank 0 to a node or placement group bundle "
                         "(a scheduling_strategy), or the ranks cannot know its address")
    probe = ray.remote(rendezvous_point).options(num_cpus=0, scheduling_strategy=strategy)
    return ray.get(probe.remote(), timeout=RENDEZVOUS_TIMEOUT_S)


def trainer_device_type(device: str, world_size: int, cluster_gpus: float) -> str:
    """'cpu' or 'cuda' for a `train.compute.device` setting, given the GPUs Ray can hand out.

    'auto' picks CUDA only when every rank can have its own GPU.
    """
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        if cluster_gpus < world_size:
            raise ConfigError(
                f"train.compute.device='cuda' with {world_size} trainer ranks needs {world_size} GPUs; Ray has "
                f"{cluster_gpus:g}: lower the train.parallel degrees or set train.compute.device='cpu'"
            )
        return "cuda"
    if device == "auto":
        return "cuda" if cluster_gpus >= world_size else "cpu"
    raise ConfigError(f"train.compute.device must be 'auto', 'cpu' or 'cuda', got {device!r}")


class ParallelTrainerRank(GRPOTrainer):
    """This process's rank of a parallel GRPO trainer (run it as a Ray actor, one per rank).

    Methods that return data (step's metrics, the pushed state dict, save's path) return it on
    rank 0 and None elsewhere, except get_version and load_state, which every rank answers.
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, setup: TrainerSetup) -> None:
        """Loads the full policy, joins the world (blocks until every rank has), then shards it.

        setup.device_type: 'cpu' (gloo) or 'cuda' (NCCL; the actor holds one GPU, so LOCAL_RANK is 0).
        """
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_RANK="0" if setup.device_type == "cuda" else str(rank),
        )
        super().__init__(setup)

    def ready(self) -> int:
        """This actor's rank, once the world is joined and the model sharded."""
        return self.rank


class TrainerGroup:
    """GRPOTrainer's interface over a torch.distributed world of Ray actors (run it as a Ray actor)."""

    def __init__(self, setup: TrainerSetup, *, rank_options: list[dict[str, Any]] | None = None) -> None:
        """Starts the rank actors and waits until every one has joined the world and sharded the model.

        rank_options: Ray actor options per rank (resources and a scheduling strategy that pins
        it, e.g. `Placement.rank_options(r)`); None runs every rank on this actor's node.
        setup.device_type: 'cpu' or 'cuda' (what the placement reserved); None decides by
        `trainer_device_type` from the cluster's GPUs (a group built by hand).
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        n = setup.train.parallel.world_size
        device_type = setup.device_type
        if device_type is None:
            device_type = trainer_device_type(setup.train.compute.device, n, ray.cluster_resources().get("GPU", 0))
            setup = dataclasses.replace(setup, device_type=device_type)
        if rank_options is None:
            # One machine: this node's address (127.0.0.1 on a loopback Ray) is rank 0's.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            rank_options = [dict(num_cpus=0, num_gpus=1 if device_type == "cuda" else 0, scheduling_strategy=here)] * n
            addr, port = rendezvous_point()
        else:
            if len(rank_options) != n:
                raise ValueError(f"rank_options has {len(rank_options)} entries for a world of {n} ranks")
            addr, port = rank0_rendezvous_point(rank_options[0])
        self.ranks = [
            ray.remote(ParallelTrainerRank).options(**rank_options[r]).remote(r, n, addr, port, setup)
            for r in range(n)
        ]
        self.broken: str | None = None
        """Why the world can no longer run (a rank failed mid-collective); None while healthy."""
        self._all("ready")

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Calls `method` on every rank; their results by rank. On the first failure the world is
        torn down (the other ranks would wait in a collective forever) and the error raised."""
        import ray

        if self.broken is not None:
            raise RuntimeError(f"the parallel trainer stopped earlier ({self.broken}); restart the run")
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except BaseException as e:
                    self.broken = f"rank {index[ref]} failed in {method}: {type(e).__name__}"
                    for rank in self.ranks:
                        ray.kill(rank)
                    raise
        return results

    # ------------------------------------------------------------------------- GRPOTrainer's methods

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One policy update on every rank; rank 0's metrics (every rank computes the same)."""
        import ray

        shared = ray.put(groups)  # one copy in the object store for all ranks
        return self._all("step", shared)[0]

    def state_dict_for_push(self) -> dict[str, Any]:
        """HF-named full tensors for the rollout workers, gathered to rank 0."""
        return self._all("state_dict_for_push")[0]

    def get_version(self) -> PolicyVersion:
        return self._all("get_version")[0]

    def save(self, out_dir: str) -> str:
        """Exports the current policy as an HF checkpoint directory."""
        return self._all("save", out_dir)[0]

    def save_state(self, dir: str) -> None:
        """Writes a training checkpoint (GRPOTrainer.save_state's layout) collectively."""
        self._all("save_state", dir)

    def load_state(self, dir: str) -> int:
        """Restores a training checkpoint written under any layout; returns the version."""
        versions = self._all("load_state", dir)
        if len(set(versions)) != 1:
            raise RuntimeError(f"trainer ranks restored different versions from {dir}: {versions}")
        return versions[0]

    # ------------------------------------------------------------------------- weight sync (rank 0 sends)

    def open_weight_sync(self, plan: Any) -> None:
        """GRPOTrainer.open_weight_sync: rank 0 opens the transport (broadcast: returns once every
        worker joined); the other ranks only join the gathers of later pushes."""
        self._all("open_weight_sync", plan)

    def publish_weights(self, version: int) -> Any:
        """GRPOTrainer.publish_weights, gathered to rank 0; rank 0's announcement."""
        return self._all("publish_weights", version)[0]

    def send_weights(self, version: int) -> float:
        """GRPOTrainer.send_weights (broadcast: gathered and streamed bucket by bucket)."""
        return self._all("send_weights", version)[0]

    def close_weight_sync(self) -> None:
        self._all("close_weight_sync")
