"""The parallel trainer as one Ray actor with GRPOTrainer's methods, owning one actor per rank.

The driver starts `TrainerGroup` exactly as it starts `GRPOTrainer`
(`ray.remote(TrainerGroup).options(num_cpus=0).remote(model, train, temperature, seed, ...)`),
so the loop's `trainer.step.remote(groups)` etc. work unchanged. The group starts
`train.parallel.world_size` `ParallelTrainerRank` actors, which rendezvous with torch.distributed
on 127.0.0.1 and a free port, forwards every call to all of them (collectives need every rank),
and returns rank 0's answer. The rank actors are owned by the group: killing the group ends them.
"""

from __future__ import annotations

from typing import Any

from titanrl.config import ConfigError, ModelConfig, TrainConfig
from titanrl.types import Group, PolicyVersion

MASTER_ADDR = "127.0.0.1"
"""Rendezvous address: this machine (the rank actors run on the local Ray node)."""


def trainer_device_type(device: str, world_size: int, cluster_gpus: float) -> str:
    """'cpu' or 'cuda' for a `train.device` setting, given the GPUs Ray can hand out.

    'auto' picks CUDA only when every rank can have its own GPU.
    """
    if device == "cpu":
        return "cpu"
    if device == "cuda":
        if cluster_gpus < world_size:
            raise ConfigError(
                f"train.device='cuda' with {world_size} trainer ranks needs {world_size} GPUs; Ray has "
                f"{cluster_gpus:g}: lower the train.parallel degrees or set train.device='cpu'"
            )
        return "cuda"
    if device == "auto":
        return "cuda" if cluster_gpus >= world_size else "cpu"
    raise ConfigError(f"train.device must be 'auto', 'cpu' or 'cuda', got {device!r}")


class TrainerGroup:
    """GRPOTrainer's interface over a torch.distributed world of Ray actors (run it as a Ray actor)."""

    def __init__(
        self, model_config: ModelConfig, train_config: TrainConfig, temperature: float, seed: int,
        batch_invariant: bool = False,
    ) -> None:
        """Starts the rank actors and waits until every one has joined the world and sharded the model."""
        import ray

        from titanrl.trainer.parallel.actor import ParallelTrainerRank
        from titanrl.trainer.parallel.launch import free_port

        n = train_config.parallel.world_size
        device_type = trainer_device_type(train_config.device, n, ray.cluster_resources().get("GPU", 0))
        port = free_port()
        rank_cls = ray.remote(ParallelTrainerRank).options(num_cpus=0, num_gpus=1 if device_type == "cuda" else 0)
        self.ranks = [
            rank_cls.remote(r, n, MASTER_ADDR, port, device_type, model_config, train_config, temperature, seed,
                            batch_invariant)
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
