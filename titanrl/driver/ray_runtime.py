"""Ray for TitanRL's actors: a local instance on loopback or a joined cluster, and user code shipped to the actors."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def init_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Starts a local Ray instance for TitanRL's actors, or joins the cluster at `address`
    (`RunConfig.ray_address`, e.g. '10.0.0.1:6379' or 'auto'); nothing if Ray is already up.

    A local instance's traffic stays on loopback: Ray turns "127.0.0.1" into the host's routable
    address unless its multi-node mode is off (the switch it uses on macOS), so turn it off here;
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 to opt back in. A cluster keeps the addresses its
    nodes were started with (`ray start --node-ip-address`), and its own CPU count.
    """
    if address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return
    if address is None:
        from ray._private import ray_constants

        # The constant is read when Ray is imported, which may have happened before this call.
        ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")
        # Keep Ray's own traffic on loopback: a single-machine run needs no other address. 'local':
        # a Ray of its own even when `ray start` left a cluster on this machine (ray.init() would
        # join that one, and refuse num_cpus there); joining one is what --ray_address is for.
        start: dict[str, Any] = dict(address="local", _node_ip_address="127.0.0.1",
                                     num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False)
    else:
        if num_cpus is not None:
            raise ValueError("init_ray: num_cpus is the joined Ray cluster's own; leave it None with an address")
        start = dict(address=address)
    # Actors must import whatever the driver imported the reward functions from.
    pythonpath = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
    ray.init(
        **start,
        logging_level="WARNING",
        log_to_driver=True,
        runtime_env={"env_vars": {
            "PYTHONPATH": pythonpath,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # One malloc arena for every thread (a value exported here is kept). glibc gives each
            # new thread an arena of its own, whose heaps it trims and maps again as tensors come
            # and go: a continuous worker's engine thread took ~16k page faults and 9 % more CPU
            # per arithmetic batch there than with one arena (benchmarks/engine_thread.py).
            "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "1"),
            # vLLM's CPU start-up warnings (tcmalloc, Triton, NUMA) are noise for a user; export
            # VLLM_LOGGING_LEVEL=WARNING (or INFO) to see them.
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
            "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning"),
        }},
    )


def ship_user_code_by_value(callables: list[Any]) -> None:
    """Rewards and env factories from user files travel to the actors by value.

    Actors may not be able to import a config file's neighbours by name (Ray may have been
    started before that folder went on sys.path), so anything not from an installed package
    is pickled with its module's code instead of as an import reference.
    """
    import sysconfig

    from ray import cloudpickle

    installed = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    installed.add(Path(__file__).resolve().parent)  # titanrl itself
    for fn in callables:
        if isinstance(fn, str):
            continue
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        file = getattr(module, "__file__", None)
        if module is None or module.__name__ == "__main__" or file is None:
            continue  # cloudpickle already sends __main__ by value
        path = Path(file).resolve()
        if not any(root == path or root in path.parents for root in installed):
            cloudpickle.register_pickle_by_value(module)
