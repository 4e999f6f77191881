"""Placement of a run's actors with a Ray placement group: the layout, a local loopback Ray, and a
three-node `ray.cluster_utils.Cluster` on loopback joined with `init_ray(address=...)`.

The cluster runs in a subprocess (this file run as a script): joining it replaces whatever Ray
this process is connected to, and the session's `ray_session` Ray must outlive this test for
the tests after it. The subprocess writes what it saw as JSON; the assertions are made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titanrl.config import ComputeConfig, ConfigError, ParallelConfig, RolloutConfig, RunConfig, TrainConfig
from titanrl.driver.placement import TOKEN_CPU, Placement, check_fits, plan_layout, weight_sync_options
from titanrl.trainer.setup import TrainerSetup


def _config(world: int = 1, workers: int = 1, device: str = "cpu", threads: int = 1) -> RunConfig:
    return RunConfig(
        rollout=RolloutConfig(num_workers=workers),
        train=TrainConfig(
            parallel=ParallelConfig(dp_shard=world), compute=ComputeConfig(device=device, threads=threads)
        ),
    )


# --- the layout, without Ray --------------------------------------------------------------
def test_custom_resources_pin_roles_to_nodes_and_a_missing_one_is_named():
    """cluster.trainer_resource / worker_resource add 1 of that resource to each rank's / worker's
    bundle; a cluster without enough of it is refused naming the resource and the `ray start` to fix it."""
    config = _config(world=2, workers=3)
    config.cluster.trainer_resource, config.cluster.worker_resource = "titanrl_trainer", "titanrl_rollout"
    layout = plan_layout(config, 0.0)
    assert layout.rank_bundle == {"CPU": TOKEN_CPU, "titanrl_trainer": 1.0}
    assert layout.worker_bundle == {"CPU": TOKEN_CPU, "titanrl_rollout": 1.0}
    nodes = [{"CPU": 1.0, "titanrl_trainer": 2.0}, {"CPU": 1.0, "titanrl_rollout": 2.0}]
    with pytest.raises(ConfigError, match=r"needs 3 of the custom resource 'titanrl_rollout' \(3 rollout worker\(s\) "
                                          r"x 1\), the Ray cluster has 2: start the nodes .*"
                                          r"--resources='\{\"titanrl_rollout\": N\}'.*cluster.worker_resource"):
        check_fits(layout, nodes)
    with pytest.raises(ConfigError, match=r"custom resource 'titanrl_trainer'.*cluster.trainer_resource"):
        check_fits(layout, [{"CPU": 4.0, "titanrl_rollout": 4.0}])
    check_fits(layout, [*nodes, {"CPU": 1.0, "titanrl_rollout": 1.0}])  # fits: no error


def test_layout_bundles_and_what_cannot_fit():
    """Trainer rank bundles come first, then one per worker; CPUs are a token unless reserved
    (then each actor's threads); a GPU per CUDA rank and per GPU engine; 'auto' gives the trainer
    CUDA only if the workers leave a GPU per rank. A cluster too small for the whole layout, or
    for one bundle, is refused with the number needed and the setting to lower."""
    token = plan_layout(_config(world=2, workers=2), 0.0)
    assert token.bundles == [{"CPU": TOKEN_CPU}] * 4
    assert (token.trainer_device, token.rollout_device) == ("cpu", "cpu")

    gpus = plan_layout(_config(world=2, workers=2, device="cuda", threads=3), 4.0, reserve_cpus=True,
                       rollout_device="cuda")
    assert gpus.bundles == [{"CPU": 3.0, "GPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}] * 2
    assert plan_layout(_config(world=2, workers=2, device="auto"), 3.0, rollout_device="cuda").trainer_device == "cpu"
    assert plan_layout(_config(world=2, workers=2, device="auto"), 4.0, rollout_device="cuda").trainer_device == "cuda"

    with pytest.raises(ConfigError, match=r"needs 4 GPUs \(2 trainer rank\(s\) x 1; 2 rollout worker\(s\) x 1\), "
                                          r"the Ray cluster has 1: lower the train.parallel degrees"):
        check_fits(gpus, [{"CPU": 64.0, "GPU": 1.0}])
    with pytest.raises(ConfigError, match=r"a trainer rank needs 3 CPUs on one node, the largest Ray node has 2: "
                                          r"lower train.compute.threads"):
        check_fits(gpus, [{"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}])
    check_fits(gpus, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}])  # fits: no error


def test_shared_memory_is_refused_across_machines_and_a_broadcast_meets_on_the_trainers_node():
    """shared_memory binds one machine: bundles on two addresses are refused with a message naming
    object_store (nodes that share an address are one machine and pass). A broadcast across
    machines meets at the trainer node's rendezvous point; on one machine it stays on loopback."""
    cpu = plan_layout(_config(world=1, workers=2), 0.0)
    with pytest.raises(ConfigError, match=r"weight_transport='shared_memory' needs the trainer and every rollout "
                                          r"worker on one machine.*'object_store'"):
        weight_sync_options("shared_memory", cpu, ["10.0.0.1", "10.0.0.1", "10.0.0.2"])
    across = ["10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert weight_sync_options("broadcast", cpu, across, ("10.0.0.1", 29500)) == {
        "backend": "gloo", "host": "10.0.0.1", "port": 29500}
    with pytest.raises(ValueError, match="rendezvous point"):
        weight_sync_options("broadcast", cpu, across)


@pytest.mark.parametrize("transport", ["shared_memory", "broadcast"])
def test_one_machine_weight_sync_options_and_nccl_only_on_gpus(transport):
    """On one machine both transports need nothing but the backend: NCCL only when both the
    trainer and the engines run on GPUs."""
    cpu = plan_layout(_config(world=1, workers=2), 0.0)
    assert weight_sync_options(transport, cpu, ["127.0.0.1"] * 3) == {"backend": "gloo"}
    assert weight_sync_options("object_store", cpu, ["10.0.0.1", "10.0.0.2", "10.0.0.3"]) == {"backend": "gloo"}
    gpus = plan_layout(_config(world=1, workers=2, device="cuda"), 3.0, rollout_device="cuda")
    assert weight_sync_options(transport, gpus, ["127.0.0.1"] * 3) == {"backend": "nccl"}
    mixed = plan_layout(_config(world=1, workers=2, device="cuda"), 1.0, rollout_device="cpu")
    assert weight_sync_options(transport, mixed, ["127.0.0.1"] * 3) == {"backend": "gloo"}


# --- one machine ----------------------------------------------------------------------------
def test_local_placement_fits_two_cpus_and_rendezvous_stays_on_loopback(ray_session):
    """On the tests' 2-CPU loopback Ray, a 2-rank trainer and 2 workers are placed on its one node
    at once; the ranks' options pin them to their bundles, and rank 0's rendezvous address is
    127.0.0.1. Removing the placement frees every CPU again."""
    from titanrl.trainer.trainer_group import rank0_rendezvous_point

    ray = ray_session
    free_before = ray.available_resources().get("CPU")
    placement = Placement.create(_config(world=2, workers=2), timeout_s=10)
    try:
        (node,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert placement.bundle_nodes() == [node] * 4
        assert placement.summary() == ("trainer (2 rank(s), cpu) on 1 node(s) [127.0.0.1], 2 rollout worker(s) "
                                       "(cpu) on 1 node(s) [127.0.0.1]; 1 node(s) in all")
        kwargs = placement.trainer_kwargs()
        assert placement.layout.trainer_device == "cpu" and len(kwargs["rank_options"]) == 2
        assert placement.trainer_options()["num_cpus"] == 0  # the group only coordinates
        assert placement.worker_options(1)["scheduling_strategy"].placement_group_bundle_index == 3
        assert "runtime_env" not in placement.worker_options(0)  # not a batch-invariant run
        addr, port = rank0_rendezvous_point(placement.rank_options(0))
        assert addr == "127.0.0.1" and port > 0
    finally:
        placement.remove()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != free_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == free_before


def test_batch_invariant_runs_put_the_mkl_mode_in_every_actor_environment(ray_session):
    """Every actor of a batch-invariant run gets `mkl_mode.actor_env()` (MKL_CBWR on AVX-512 CPUs)."""
    import dataclasses

    from titanrl.kernels.mkl_mode import actor_env

    placement = Placement.create(dataclasses.replace(_config(world=2, workers=1), batch_invariant=True), timeout_s=10)
    try:
        assert placement.env_vars == actor_env()
        every = [placement.trainer_options(), placement.rank_options(0), placement.rank_options(1),
                 placement.worker_options(0)]
        expected = {"env_vars": actor_env()} if actor_env() else None
        assert [options.get("runtime_env") for options in every] == [expected] * 4
    finally:
        placement.remove()


def test_trainer_group_without_placement_keeps_one_machine(ray_session, tmp_path):
    """A TrainerGroup started as before (no rank options) still forms its 2-rank gloo world: its
    ranks run on the group's node and rendezvous on that node's Ray address, 127.0.0.1 here, which
    is also what the group's own rendezvous_point reports."""
    from titanrl.config import ModelConfig
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer_group import TrainerGroup, rendezvous_point

    ray = ray_session
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=5, std=0.1)
    group = (
        ray.remote(TrainerGroup)
        .options(num_cpus=0)
        .remote(
            TrainerSetup(
                ModelConfig(checkpoint=str(ckpt)),
                TrainConfig(parallel=ParallelConfig(dp_shard=2), compute=ComputeConfig(device="cpu")),
                1.0,
                0,
            )
        )
    )
    try:
        assert ray.get(group.get_version.remote(), timeout=120) == 0
        addr, _ = ray.get(ray.remote(rendezvous_point).options(num_cpus=0).remote())
        assert addr == "127.0.0.1"
    finally:
        ray.kill(group)


# --- a multi-node cluster on loopback -------------------------------------------------------
def test_multi_node_cluster_placement_rendezvous_and_errors(tmp_path):
    """A head and two worker nodes (1 CPU each; 0, 2 and 1 fake GPUs), all on 127.0.0.1, joined
    with init_ray(address=...):
    - with CPUs reserved, a 2-rank trainer and a worker take one node each; actors started with
      the placement's options run on their bundle's node; a real TrainerGroup (FSDP, gloo) given
      the ranks' options rendezvouses across two nodes on 127.0.0.1 and gathers exactly the
      checkpoint's weights;
    - on GPUs, both trainer ranks share the 2-GPU node and the GPU worker gets the 1-GPU node;
    - a run needing more GPUs than exist, or a bundle larger than any node, is refused at once;
      one whose resources are held by another placement gives up after its 2 s timeout."""
    out = tmp_path / "cluster.json"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, str(out), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=180, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-6000:]
    seen = json.loads(out.read_text())

    names = seen["nodes"]  # node id -> head / a / b
    assert seen["node_ips"] == ["127.0.0.1"] * 3 and seen["driver_ip"] == "127.0.0.1"

    cpu = seen["cpu"]
    assert sorted(names[n] for n in cpu["bundle_nodes"]) == ["a", "b", "head"]  # one bundle per 1-CPU node
    assert cpu["actor_nodes"] == cpu["bundle_nodes"]
    assert cpu["actor_ips"] == ["127.0.0.1"] * 3
    assert cpu["rendezvous_ip"] == "127.0.0.1"
    assert cpu["group_version"] == 0 and cpu["pushed_tensors"] > 0 and cpu["pushed_equal"]

    gpu = seen["gpu"]
    assert [names[n] for n in gpu["bundle_nodes"]] == ["a", "a", "b"]
    assert gpu["actor_nodes"] == gpu["bundle_nodes"]
    assert gpu["actor_gpus"] == [1, 1, 1]

    assert "needs 4 GPUs" in seen["too_many_gpus"]["error"]
    assert "the Ray cluster has 3: lower" in seen["too_many_gpus"]["error"]
    assert "a trainer rank needs 2 CPUs on one node" in seen["too_big_bundle"]["error"]
    # Refused before any wait (ConfigError from the fit check, not the 2 s PlacementTimeout).
    assert seen["too_many_gpus"]["type"] == seen["too_big_bundle"]["type"] == "ConfigError"
    assert seen["busy"]["type"] == "PlacementTimeout" and "within 2 s" in seen["busy"]["error"]
    assert seen["busy"]["seconds"] >= 2  # it did wait for the timeout before giving up


class _Where:
    """A plain actor that says where it runs."""

    def where(self) -> tuple[str, str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), len(ray.get_gpu_ids())


def _cluster_scenario(out: Path, tmp: Path) -> None:
    """The cluster half of the multi-node test (runs in its own process; see the module docstring)."""
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from titanrl.config import ModelConfig
    from titanrl.driver.ray_runtime import init_ray
    from titanrl.models.hf_checkpoint import read_state_dict
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer_group import TrainerGroup, rank0_rendezvous_point

    loopback = dict(node_ip_address="127.0.0.1", include_dashboard=False)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, num_gpus=0, **loopback))
    seen: dict = {}
    try:
        a = cluster.add_node(num_cpus=1, num_gpus=2, **loopback)
        b = cluster.add_node(num_cpus=1, num_gpus=1, **loopback)
        init_ray(address=cluster.address)
        seen["nodes"] = {cluster.head_node.node_id: "head", a.node_id: "a", b.node_id: "b"}
        seen["node_ips"] = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        seen["driver_ip"] = ray.util.get_node_ip_address()
        where = ray.remote(_Where)

        def actors_at(placement: Placement) -> tuple[list, list, list]:
            n = placement.layout.world_size
            opts = [placement.rank_options(r) for r in range(n)]
            opts += [placement.worker_options(i) for i in range(placement.layout.num_workers)]
            actors = [where.options(**o).remote() for o in opts]
            found = ray.get([x.where.remote() for x in actors], timeout=60)
            for x in actors:
                ray.kill(x)
            return [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]

        # CPUs reserved: one bundle per 1-CPU node; a real 2-rank group across two of them.
        placement = Placement.create(_config(world=2, workers=1), reserve_cpus=True, timeout_s=30)
        ckpt = write_tiny_checkpoint(tmp / "ckpt", seed=5, std=0.1)
        nodes, ips, _ = actors_at(placement)
        addr, _port = rank0_rendezvous_point(placement.rank_options(0))
        train = TrainConfig(parallel=ParallelConfig(dp_shard=2), compute=ComputeConfig(device="cpu"))
        setup = TrainerSetup(
            ModelConfig(checkpoint=str(ckpt)), train, 1.0, 0, device_type=placement.layout.trainer_device
        )
        group = ray.remote(TrainerGroup).options(**placement.trainer_options()).remote(
            setup, **placement.trainer_kwargs())
        version = ray.get(group.get_version.remote(), timeout=120)
        pushed = ray.get(group.state_dict_for_push.remote(), timeout=60)
        ref = read_state_dict(ckpt)
        seen["cpu"] = dict(bundle_nodes=placement.bundle_nodes(), actor_nodes=nodes, actor_ips=ips,
                           rendezvous_ip=addr, group_version=version, pushed_tensors=len(pushed),
                           pushed_equal=all(torch.equal(t, ref[k]) for k, t in pushed.items()))
        ray.kill(group)
        placement.remove()

        # GPUs: trainer ranks together on the 2-GPU node, the GPU engine on the other.
        placement = Placement.create(_config(world=2, workers=1, device="cuda"), rollout_device="cuda", timeout_s=30)
        nodes, _, gpus = actors_at(placement)
        seen["gpu"] = dict(bundle_nodes=placement.bundle_nodes(), actor_nodes=nodes, actor_gpus=gpus)
        placement.remove()

        def failure(**create) -> dict:
            t0 = time.perf_counter()
            try:
                Placement.create(**create).remove()
            except Exception as e:
                return dict(type=type(e).__name__, error=str(e), seconds=time.perf_counter() - t0)
            return dict(type=None, error="placed", seconds=time.perf_counter() - t0)

        seen["too_many_gpus"] = failure(config=_config(world=2, workers=2, device="cuda"), rollout_device="cuda")
        seen["too_big_bundle"] = failure(config=_config(threads=2), reserve_cpus=True)
        held = Placement.create(_config(world=1, workers=2), reserve_cpus=True, timeout_s=30)  # every CPU
        seen["busy"] = failure(config=_config(), reserve_cpus=True, timeout_s=2)
        held.remove()
    finally:
        out.write_text(json.dumps(seen))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _cluster_scenario(Path(sys.argv[1]), Path(sys.argv[2]))
