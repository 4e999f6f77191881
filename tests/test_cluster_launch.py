"""The cluster launch files (examples/cluster): the Slurm script passes `bash -n`, the KubeRay
manifest parses as a RayJob, and the `titanrl train` options both pass are ones the CLI accepts,
on the config they name."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import yaml

from titanrl.cli import load_config_file
from titanrl.config import apply_overrides

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"


def _train_options(command: str) -> tuple[str, list[str]]:
    """The config file and `--key=value` options of a `titanrl train CONFIG ...` command line
    (shell variables replaced by sample values)."""
    words = shlex.split(command.replace("$HEAD_IP:$PORT", "10.0.0.1:6379").replace('"$CONFIG"', "CONFIG")
                        .replace('"$@"', "").replace("\\\n", " "))
    words = words[words.index("train") + 1:]
    config = words[0]
    options = [w for w in words[1:] if w.startswith("--") and "=" in w]
    return config, options


def test_the_slurm_script_is_valid_bash_and_its_train_options_parse():
    script = CLUSTER / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    command = text[text.index('"$TITANRL" train'):]
    _, options = _train_options(command)
    assert "--cluster.trainer_resource=titanrl_trainer" in options
    config = apply_overrides(load_config_file(str(ROOT / "examples" / "arithmetic" / "config.py")), options)
    assert config.ray_address == "10.0.0.1:6379" and config.cluster.worker_resource == "titanrl_rollout"
    for resource in ("titanrl_trainer", "titanrl_rollout"):  # what `ray start` gives the nodes
        assert f'"{resource}"' in text.replace('\\"', '"')


def test_the_kuberay_manifest_is_a_rayjob_whose_entrypoint_parses():
    job = yaml.safe_load((CLUSTER / "kuberay-rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]["rayClusterSpec"]
    assert "titanrl_trainer" in spec["headGroupSpec"]["rayStartParams"]["resources"]
    assert all("titanrl_rollout" in group["rayStartParams"]["resources"] for group in spec["workerGroupSpecs"])
    config_file, options = _train_options(job["spec"]["entrypoint"])
    config = apply_overrides(load_config_file(str(ROOT / config_file)), options)
    assert config.ray_address == "auto" and config.rollout.num_workers == 4
    assert (config.cluster.trainer_resource, config.cluster.worker_resource) == ("titanrl_trainer", "titanrl_rollout")
