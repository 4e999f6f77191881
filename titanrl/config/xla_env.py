"""The XLA trainer's environment (train.compute.device='xla'): its interpreter, its actor's env vars, its checks.

torch_xla 2.9 pins torch 2.9 while vLLM's CPU build pins torch 2.13, so the trainer actor runs
under another interpreter (`make xla-venv` builds .venv-xla) and the rollout workers stay in the
driver's. What crosses between the two is plain data (titanrl.weight_sync.plain_tensors); every
weight transport works between them (broadcast's gloo group joins torch 2.9 and 2.13: measured).
`validate_xla` refuses, before any actor starts, what this path cannot run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.config.schema import ParallelConfig, RunConfig, TrainConfig
from titanrl.errors import ConfigError

XLA_VENV = ".venv-xla"
"""The folder `make xla-venv` builds (pyproject's `xla` extra)."""

XLA_ENV_PREFIXES = ("PJRT_", "XLA_", "TPU_", "LIBTPU", "CPU_NUM_DEVICES")
"""The user's environment variables that reach the XLA trainer actor (device choice, device count, flags)."""

_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
print(json.dumps({"torch": version("torch"), "torch_xla": version("torch_xla"), "ray": version("ray"),
                  "titanrl": u.find_spec("titanrl") is not None, "python": sys.version.split()[0]}))
"""
"""Run by the XLA interpreter: what it holds, read from package metadata (importing torch costs seconds)."""


@dataclass(frozen=True)
class XlaEnvironment:
    """What an XLA interpreter holds."""

    python: str
    """The interpreter's path."""
    torch: str
    """torch's version there."""
    torch_xla: str
    """torch_xla's version there."""
    ray: str
    """Ray's version there (must equal the driver's: the actors talk to the driver's Ray)."""


def checkout_root() -> Path:
    """The folder holding the titanrl package (a checkout's root for an editable install)."""
    return Path(__file__).resolve().parents[2]


def xla_python(train: TrainConfig) -> Path:
    """The interpreter of the XLA trainer actor: train.compute.xla_python, else .venv-xla/bin/python in the
    current directory or the titanrl checkout. Raises ConfigError when there is none."""
    if train.compute.xla_python:
        path = Path(train.compute.xla_python).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(f"train.compute.xla_python={train.compute.xla_python!r} is not an executable file: "
                              "point it at the "
                              f"python of an environment with torch_xla (`make xla-venv` builds {XLA_VENV})")
        return path
    candidates = [Path.cwd() / XLA_VENV / "bin" / "python", checkout_root() / XLA_VENV / "bin" / "python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ConfigError(
        "train.compute.device='xla' runs the trainer in its own environment (torch_xla pins torch 2.9), but there "
        "is no "
        f"{XLA_VENV} in {Path.cwd()} or {checkout_root()}: run `make xla-venv` in the titanrl checkout, or set "
        "train.compute.xla_python to the python of an environment with torch_xla and ray, or set "
        "train.compute.device='cpu'"
    )


def actor_pythonpath() -> str:
    """PYTHONPATH for the XLA actor: the driver's own paths (its current directory, user code, a
    titanrl checkout), never its environment's site-packages or stdlib, which hold another torch."""
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}

    def own(entry: str) -> bool:
        path = Path(entry).resolve()
        return not any(path == p or p in path.parents for p in prefixes)

    roots = [os.getcwd(), str(checkout_root()), *sys.path]
    kept: list[str] = []
    for entry in roots:
        if entry and own(entry) and entry not in kept:
            kept.append(entry)
    return os.pathsep.join(kept)


def has_tpu() -> bool:
    """A TPU VM's accelerator device files."""
    return any(Path("/dev").glob("accel*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def actor_env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Env vars of the XLA trainer actor: PJRT_DEVICE (the user's; TPU on a TPU VM, else XLA's CPU
    device), the user's XLA settings (CPU_NUM_DEVICES, XLA_FLAGS, ...) and `actor_pythonpath`."""
    environ = dict(os.environ if environ is None else environ)
    out = {k: v for k, v in environ.items() if k.startswith(XLA_ENV_PREFIXES)}
    out.setdefault("PJRT_DEVICE", "TPU" if has_tpu() else "CPU")
    out["PYTHONPATH"] = actor_pythonpath()
    return out


def xla_runtime_env(train: TrainConfig) -> dict[str, Any]:
    """Ray `runtime_env` that starts the trainer actor under the XLA interpreter."""
    return {"py_executable": str(xla_python(train)), "env_vars": actor_env_vars()}


@functools.cache
def probe_xla_environment(python: str) -> XlaEnvironment:
    """Reads torch, torch_xla and Ray's versions in `python` (as the actor will see them); raises
    ConfigError when one is missing or Ray's differs from the driver's."""
    import importlib.metadata

    env = {**os.environ, "PYTHONPATH": actor_pythonpath()}
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env)
        found = json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        raise ConfigError(f"train.compute.device='xla': could not run the XLA interpreter {python} ({e}): rebuild it "
                          f"with `make xla-venv`, or set train.compute.xla_python") from e
    missing = [name for name in ("torch", "torch_xla", "ray") if found[name] is None]
    if not found["titanrl"]:
        missing.append("titanrl")
    if missing:
        raise ConfigError(
            f"train.compute.device='xla': the XLA interpreter {python} lacks {', '.join(missing)}: rebuild "
            f"it with `make xla-venv` (pyproject's `xla` extra), or set train.compute.xla_python"
        )
    ours = importlib.metadata.version("ray")
    if found["ray"] != ours:
        raise ConfigError(
            f"train.compute.device='xla': the XLA interpreter {python} has ray {found['ray']}, this one ray "
            f"{ours}; they must be equal: install ray=={ours} there (`make xla-venv` pins it)"
        )
    return XlaEnvironment(python, found["torch"], found["torch_xla"], found["ray"])


SPMD_DEGREES = ("dp_replicate", "dp_shard", "tp")
"""Degrees that become axes of the XLA SPMD mesh (in this order)."""

XLA_UNSUPPORTED_DEGREES = ("pp", "cp", "ep")
"""Degrees with no SPMD form here: pipeline, ring-attention context and expert parallel."""


def check_xla_layout(parallel: ParallelConfig, devices: int | None = None) -> None:
    """Refuses a layout the XLA trainer does not run. devices: what torch_xla sees (None: not
    known here, e.g. on a TPU seen from the driver); the mesh must cover them all, or be 1."""
    for name in XLA_UNSUPPORTED_DEGREES:
        if getattr(parallel, name) != 1:
            raise ConfigError(f"train.parallel.{name}={getattr(parallel, name)} is not supported with "
                              f"train.compute.device='xla' (SPMD shards {', '.join(SPMD_DEGREES)}): set it to 1")
    size = mesh_size(parallel)
    if devices is not None and size not in (1, devices):
        raise ConfigError(
            f"train.parallel dp_replicate x dp_shard x tp = {size} but torch_xla sees {devices} devices "
            f"(CPU_NUM_DEVICES={os.environ.get('CPU_NUM_DEVICES', 'unset')} on XLA's CPU device): export "
            f"CPU_NUM_DEVICES={size}, or make the product 1")


def mesh_size(parallel: ParallelConfig) -> int:
    """Devices of the SPMD mesh `parallel` describes."""
    return parallel.dp_replicate * parallel.dp_shard * parallel.tp


def xla_cpu_devices(environ: dict[str, str] | None = None) -> int | None:
    """The device count of XLA's CPU device (CPU_NUM_DEVICES, default 1) when the actor will run on
    it (PJRT_DEVICE=CPU, or unset without a TPU); None on a TPU, whose count the actor finds."""
    environ = os.environ if environ is None else environ
    if environ.get("PJRT_DEVICE", "TPU" if has_tpu() else "CPU") != "CPU":
        return None
    value = environ.get("CPU_NUM_DEVICES", "") or "1"
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"CPU_NUM_DEVICES={value!r} must be a positive integer (XLA's CPU device count)")
    return int(value)


def check_xla_training(train: TrainConfig, batch_invariant: bool) -> None:
    """Refuses the training settings the XLA trainer does not run (validation, and the trainer
    itself when built from Python)."""
    if batch_invariant:
        raise ConfigError(
            "batch_invariant=True is not supported with train.compute.device='xla' (the invariant kernels "
            "are CPU/Triton ops, not XLA ones): set batch_invariant=False or train.compute.device='cpu'"
        )
    if train.kl.coef > 0:
        raise ConfigError(
            "train.kl.coef > 0 is not supported with train.compute.device='xla' yet (the reference policy "
            "runs outside the compiled step): set train.kl.coef=0 or train.compute.device='cpu'"
        )


def validate_xla(config: RunConfig, model_config: Any) -> None:
    """train.compute.device='xla': what the XLA trainer does not run is refused first (no probing), then the
    environment is checked. model_config: the checkpoint's config.json (`read_config`)."""
    if config.train.compute.device != "xla":
        return
    t, p = config.train, config.train.parallel
    check_xla_training(t, config.batch_invariant)
    if getattr(model_config, "num_experts", None) is not None:
        raise ConfigError("a mixture-of-experts model (model.checkpoint holds Qwen3-MoE) is not supported with "
                          "train.compute.device='xla': use a dense Qwen3 checkpoint or train.compute.device='cpu'")
    check_xla_layout(p, xla_cpu_devices())
    probe_xla_environment(str(xla_python(t)))
