"""Weight-sync benchmark: each transport's push time against the memory-copy bound.

    .venv/bin/python benchmarks/weight_sync.py [--out benchmarks/results/weight_sync.jsonl]
    .venv/bin/python benchmarks/weight_sync.py --no-multiprocess     # in-process engines only

Model: the 25M-parameter `medium` Qwen3 of benchmarks/rollout_engine.py (hidden 512, 8 layers,
8 heads / 4 KV heads, head_dim 64, intermediate 1536, tied embeddings), float32, random init.
Actors: one GRPOTrainer and two RolloutWorkers (real Ray actors, each worker with its own vLLM
engine, in-process; then the same with the multiprocess engine, engine core in its own process).

  bound_seconds   one `dst.copy_(src)` of the model's bytes in this process, best of 7: what a
                  single memory copy of the weights costs on this machine.
  seconds         median over `--repeats` pushes (after one warm-up) of the wall time from
                  `WeightSync.push(version)` (publish start) until every worker has loaded the
                  version; best_seconds is the fastest push.
  ratio           seconds / bound_seconds (target: <= 3 for the 25M model).
  load_s          the slowest worker's `receive_weights` seconds (median); send_s: the trainer's
                  `send_weights` (the transfer of broadcast and pipelined shared memory; ~0 for
                  the object store).

`legacy_update_weights` is the path before titanrl.weight_sync (state_dict_for_push, then
update_weights with the dict), for comparison. One JSON line per transport and engine, then a
summary line. Runtime ~2-3 min on 2 shared cores (mostly engine start-up).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_ADDRESS", "local")  # a Ray of its own, even while another runs on the machine

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

MEDIUM = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              intermediate_size=1536)
"""The `medium` size of benchmarks/rollout_engine.py (~25M parameters)."""
TRANSPORTS = ["object_store", "shared_memory", "broadcast"]
TARGET_RATIO = 3.0


def zero_reward(prompt: str, completion: str, **fields) -> float:
    return 0.0


def copy_bound(nbytes: int, repeats: int = 7) -> float:
    """Best time of one in-memory copy of `nbytes` (both buffers touched beforehand)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def start_workers(ray, ckpt: str, n: int, multiprocess: bool) -> list:
    from titanrl.config import ModelConfig, RolloutConfig
    from titanrl.rollout.worker import RolloutWorker

    rc = RolloutConfig(num_workers=n, max_model_len=256, max_num_seqs=8, kv_cache_gib=0.25,
                       vllm_multiprocess=multiprocess)
    workers = [ray.remote(RolloutWorker).options(num_cpus=0).remote(i, ModelConfig(checkpoint=ckpt), rc, [zero_reward],
                                                                      "prompt", 0) for i in range(n)]
    ray.get([w.ready.remote() for w in workers])
    return workers


def bench_transport(ray, trainer, workers, transport: str, repeats: int, version: int, bucket_bytes: int) -> dict:
    from titanrl.weight_sync import WeightSync

    options = {"bucket_bytes": bucket_bytes} if transport == "broadcast" else {}
    sync = WeightSync.open(trainer, workers, transport, **options)
    walls, publishes, loads = [], [], []
    try:
        for i in range(repeats + 1):
            push = sync.push(version + i)
            wall = push.wait()
            if i == 0:
                continue  # warm-up: first segment / buffers
            walls.append(wall)
            loads.append(max(ray.get(push.loads)))
            publishes.append(ray.get(push.sent))
    finally:
        sync.close()
    return {"seconds": statistics.median(walls), "best_seconds": min(walls), "load_s": statistics.median(loads),
            "send_s": statistics.median(publishes)}


def bench_legacy(ray, trainer, workers, repeats: int, version: int) -> dict:
    walls = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        weights = trainer.state_dict_for_push.remote()
        ray.get([w.update_weights.remote(weights, version + i) for w in workers])
        if i:
            walls.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(walls), "best_seconds": min(walls)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--repeats", type=int, default=5, help="timed pushes per transport (median reported)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=32, help="broadcast bucket size")
    parser.add_argument("--no-multiprocess", action="store_true", help="skip the multiprocess-engine runs")
    args = parser.parse_args(argv)

    import ray

    from titanrl.config import ModelConfig, TrainConfig
    from titanrl.driver.ray_runtime import init_ray
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.trainer.trainer import GRPOTrainer

    t_start = time.perf_counter()
    lines: list[dict] = []

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="titanrl_ws_bench_") as tmp:
        ckpt = str(write_tiny_checkpoint(Path(tmp) / "medium", seed=0, **MEDIUM))
        init_ray(num_cpus=2)
        trainer = ray.remote(GRPOTrainer).options(num_cpus=0).remote(ModelConfig(checkpoint=ckpt), TrainConfig(),
                                                                      1.0, 0)
        layout = ray.get(trainer.publish_weights.remote(0)).layout  # object_store by default: tensors + layout
        model_bytes = sum(t.nbytes for t in layout.tensors)
        bound = copy_bound(model_bytes)
        common = {"model_bytes": model_bytes, "num_tensors": len(layout.tensors), "workers": args.workers,
                  "bound_seconds": round(bound, 5)}
        version = 1
        engines = ["in_process"] + ([] if args.no_multiprocess else ["multiprocess"])
        for engine in engines:
            workers = start_workers(ray, ckpt, args.workers, engine == "multiprocess")
            for transport in TRANSPORTS:
                r = bench_transport(ray, trainer, workers, transport, args.repeats, version, args.bucket_mib << 20)
                version += args.repeats + 1
                emit({"transport": transport, "engine": engine, **{k: round(v, 5) for k, v in r.items()}, **common,
                      "ratio": round(r["seconds"] / bound, 2), "ratio_best": round(r["best_seconds"] / bound, 2),
                      **({"bucket_bytes": args.bucket_mib << 20} if transport == "broadcast" else {})})
            r = bench_legacy(ray, trainer, workers, args.repeats, version)
            version += args.repeats + 1
            emit({"transport": "legacy_update_weights", "engine": engine, **{k: round(v, 5) for k, v in r.items()},
                  **common, "ratio": round(r["seconds"] / bound, 2), "ratio_best": round(r["best_seconds"] / bound, 2)})
            ray.get([w.close.remote() for w in workers])
            for w in workers:
                ray.kill(w)
        ray.kill(trainer)
        ray.shutdown()
    ratios = {f"{ln['transport']}/{ln['engine']}": ln["ratio"] for ln in lines}
    best = min((ln for ln in lines if ln["transport"] in TRANSPORTS), key=lambda ln: ln["ratio"])
    emit({"summary": "weight_sync", "model_bytes": model_bytes, "bound_seconds": round(bound, 5), "ratios": ratios,
          "fastest": f"{best['transport']}/{best['engine']}", "fastest_ratio": best["ratio"],
          "target_ratio": TARGET_RATIO, "meets_target": {k: v <= TARGET_RATIO for k, v in ratios.items()},
          "cpus": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()],
          "total_seconds": round(time.perf_counter() - t_start, 1)})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
