"""Rollout-engine benchmark: vLLM's built-in model of a family vs TitanRL's VllmEngine (our model code).

    .venv/bin/python benchmarks/rollout_engine.py --out benchmarks/results/rollout_engine/rollout_engine.json
    .venv/bin/python benchmarks/rollout_engine.py --quick      # tiny model only (~1 min)
    .venv/bin/python benchmarks/rollout_engine.py --smoke      # tiny model, 4 prompts x n=2 x 8 tokens, 1 repeat
    .venv/bin/python benchmarks/rollout_engine.py --family llama --out benchmarks/results/rollout_engine/rollout_engine_llama_<cpu>.json

`--family` (qwen3, the default; llama; qwen2) picks the checkpoints' architecture: the built-in
arm is then vLLM's own LlamaForCausalLM / Qwen2ForCausalLM, ours the family's TitanRL class.
Family defaults otherwise: Llama without biases or rope scaling (as Llama 3 / SmolLM2), Qwen2
with its q/k/v biases.

What it measures, on one freshly written random-init checkpoint per model size (byte
tokenizer, float32):

1. Generation throughput, completion tokens per second, of
   - `builtin`: plain `vllm.LLM(model=ckpt)`, i.e. vLLM's own implementation of the family
     (Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM),
   - `ours`: `titanrl.rollout.vllm.engine.VllmEngine`, i.e. vLLM running TitanRL's modules of
     the family (`hf_overrides architectures=["TitanRL<Architecture>"]`) with vLLM's CPU kernels
     swapped in (`VllmEngineConfig.vllm_kernels=True`, the default: oneDNN GEMMs on prepacked
     weights with q/k/v and gate/up packed, vLLM's rotary op; RMSNorm stays ours, as vLLM runs it on x86), and
   - `ours_torch_kernels`: the same engine with `vllm_kernels=False` (torch's F.linear etc.,
     the state before the kernel overrides), measured side by side as the "before",
   with the same engine options (dtype float32, enforce_eager, max_model_len, max_num_seqs,
   1 GiB KV cache, prefix caching, logprobs_mode="processed_logprobs", in-process engine
   VLLM_ENABLE_V1_MULTIPROCESSING=0, OMP_NUM_THREADS=1).
   Workloads: 16 prompts x n=4 x 32 tokens and 64 prompts x n=8 x 32 tokens, 16-token
   prompts, temperature 1, `logprobs=0`, `ignore_eos=True` so every completion has exactly
   32 tokens. `VllmEngine.generate` has no ignore_eos/min_tokens option, so both arms call
   `LLM.generate` (for ours: `engine.llm.generate`) with identical SamplingParams; one extra
   run through `VllmEngine.generate` (EOS allowed, so lengths vary) is reported separately
   as `ours_generate_api` to show the cost of its Completion conversion.
   Both engines live in the same process at the same time and the timed runs alternate
   (builtin, ours, ..., then reversed) after one warm-up each, so load from other processes
   on the machine hits every arm alike; `ratio_ours_over_builtin` = median(ours) /
   median(builtin), `ratio_pairwise_median` = median of per-repeat ratios (likewise
   `ratio_ours_torch_kernels_over_builtin`). `cpu_time_ratio_*` is the same from tokens per
   second of this process's CPU time (`time.process_time`), which moves much less than wall
   time when other processes load the machine. `--sequential` instead runs the arms one after
   the other, each closed before the next starts.
   `same_tokens_fraction`: completions with identical token ids as builtin (same seeds);
   `max_logprob_diff_on_same`: largest logprob difference over those (`..._vs_torch_kernels`:
   the same between ours and ours_torch_kernels).
   The report starts with the CPU's instruction-set flags (`cpu_flags`) and the load average.
2. Weight-push time of `VllmEngine.update_weights` (full state dict, median of `--push-repeats`),
   with parameter counts, and the part of it spent serialising to safetensors bytes.

Sizes: `tiny` (hidden 128, 2 layers, ~0.3M params) and `medium` (hidden 512, 8 layers,
8 heads / 4 KV heads, head_dim 64, intermediate 1536, ~25M params); `--quick` runs tiny only.
Runtime on an idle 2-core CPU: ~6-7 min full, ~1.5 min quick (three engines). Absolute numbers depend on machine load;
the ratios are what to compare.
"""

from __future__ import annotations

import os

# Before anything imports torch/vLLM.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from titanrl.config import EngineConfig

SIZES = {
    "tiny": {},
    "medium": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
    ),
}
WORKLOADS = [(16, 4, 32), (64, 8, 32)]  # (prompts, n, completion tokens)
SMOKE_WORKLOADS = [(4, 2, 8)]
"""`--smoke`'s one workload (with the tiny size only, one repeat, one push)."""
PROMPT_LEN = 16
MAX_MODEL_LEN = 256
KV_CACHE_GIB = 1.0


def _prompts(num: int) -> list[list[int]]:
    """Deterministic 16-token prompts over byte ids (distinct, so no cross-prompt prefix hits)."""
    return [[(7 * i + 13 * j + 1) % 256 for j in range(PROMPT_LEN)] for i in range(num)]


def _model_class(llm) -> str:
    return llm.collective_rpc(lambda worker: type(worker.get_model()).__name__)[0]


def _module_classes(llm) -> list[str]:
    """The module classes of the running model (shows whether the kernel overrides are in)."""
    return llm.collective_rpc(lambda worker: sorted({type(m).__name__ for m in worker.get_model().modules()}))[0]


class Builtin:
    """Plain vllm.LLM on the checkpoint: vLLM's own implementation of the family."""

    name = "builtin"

    def __init__(self, ckpt: str, max_num_seqs: int) -> None:
        import torch
        from vllm import LLM

        self._set_num_threads = torch.set_num_threads
        t0 = time.perf_counter()
        self.llm = LLM(
            model=ckpt,
            tokenizer=ckpt,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=int(KV_CACHE_GIB * 2**30),
            enforce_eager=True,
            enable_prefix_caching=True,
            seed=0,
            logprobs_mode="processed_logprobs",
        )
        self.start_seconds = time.perf_counter() - t0

    def close(self) -> None:
        import gc

        import torch

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        torch.set_num_threads = self._set_num_threads
        gc.collect()


class Ours:
    """TitanRL's VllmEngine (our modules of the family inside vLLM, vLLM's CPU kernels swapped in)."""

    name = "ours"
    vllm_kernels = True

    def __init__(self, ckpt: str, max_num_seqs: int) -> None:
        from titanrl.rollout.vllm.engine import VllmEngine, VllmEngineConfig

        self.engine = VllmEngine(
            VllmEngineConfig(
                checkpoint=ckpt,
                dtype="float32",
                settings=EngineConfig(
                    max_model_len=MAX_MODEL_LEN,
                    max_num_seqs=max_num_seqs,
                    kv_cache_gib=KV_CACHE_GIB,
                    vllm_kernels=self.vllm_kernels,
                ),
                enforce_eager=True,
                enable_prefix_caching=True,
                seed=0,
            )
        )
        self.llm = self.engine.llm
        self.start_seconds = self.engine.start_seconds

    def close(self) -> None:
        self.engine.close()


class OursTorchKernels(Ours):
    """The same engine on torch's kernels (`vllm_kernels=False`): the before of the overrides."""

    name = "ours_torch_kernels"
    vllm_kernels = False


ARMS = (Builtin, Ours, OursTorchKernels)


def _run(llm, prompts, num_prompts: int, n: int, tokens: int, seed: int = 0):
    """One timed LLM.generate call with fixed-length completions; returns (tok/s, tok per CPU-s, outputs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:num_prompts]]
    params = [
        SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, seed=seed + j * n)
        for j in range(num_prompts)
    ]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(inputs, params, use_tqdm=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    got = sum(len(c.token_ids) for o in outs for c in o.outputs)
    expected = num_prompts * n * tokens
    if got != expected:
        raise RuntimeError(f"expected {expected} completion tokens, got {got} (ignore_eos not honoured?)")
    return got / dt, got / cpu, outs


def _compare(outs_a, outs_b) -> tuple[float, float | None]:
    """Fraction of completions with identical tokens, and max |logprob diff| over those."""
    same = total = 0
    max_diff = None
    for oa, ob in zip(outs_a, outs_b):
        for ca, cb in zip(sorted(oa.outputs, key=lambda c: c.index), sorted(ob.outputs, key=lambda c: c.index)):
            total += 1
            if list(ca.token_ids) == list(cb.token_ids):
                same += 1
                for pa, pb, t in zip(ca.logprobs, cb.logprobs, ca.token_ids):
                    d = abs(pa[t].logprob - pb[t].logprob)
                    max_diff = d if max_diff is None else max(max_diff, d)
    return same / max(total, 1), max_diff


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _bench_generation(arms, prompts, repeats: int, interleaved: bool) -> dict:
    """Warm-up + `repeats` timed runs per arm per workload; arms: {'builtin': llm, 'ours': llm}."""
    results = {}
    for num_prompts, n, tokens in WORKLOADS:
        key = f"{num_prompts}x{n}x{tokens}"
        runs: dict[str, list[float]] = {name: [] for name in arms}
        cpu_runs: dict[str, list[float]] = {name: [] for name in arms}
        last: dict[str, object] = {}
        if interleaved:
            for name, llm in arms.items():  # warm-up: the same batch shape, a few tokens
                _run(llm, prompts, num_prompts, n, 4, seed=1000)
            for r in range(repeats):
                order = list(arms) if r % 2 == 0 else list(arms)[::-1]
                for name in order:
                    tps, cpu_tps, last[name] = _run(arms[name], prompts, num_prompts, n, tokens)
                    runs[name].append(tps)
                    cpu_runs[name].append(cpu_tps)
        else:
            for name, llm in arms.items():
                _run(llm, prompts, num_prompts, n, 4, seed=1000)
                for _ in range(repeats):
                    tps, cpu_tps, last[name] = _run(llm, prompts, num_prompts, n, tokens)
                    runs[name].append(tps)
                    cpu_runs[name].append(cpu_tps)
        entry = {
            "prompts": num_prompts,
            "n": n,
            "completion_tokens_per_call": num_prompts * n * tokens,
            "tok_per_s": {name: [round(x, 1) for x in v] for name, v in runs.items()},
            "median_tok_per_s": {name: round(_median(v), 1) for name, v in runs.items()},
            "median_tok_per_cpu_s": {name: round(_median(v), 1) for name, v in cpu_runs.items()},
        }
        if "builtin" in runs and "ours" in runs:
            for name in (n for n in runs if n != "builtin"):
                suffix = "" if name == "ours" else f"_{name}"
                entry[f"ratio_{name}_over_builtin"] = round(_median(runs[name]) / _median(runs["builtin"]), 3)
                entry[f"cpu_time_ratio_{name}_over_builtin"] = round(
                    _median(cpu_runs[name]) / _median(cpu_runs["builtin"]), 3)
                entry[f"ratio_pairwise_median{suffix}"] = round(
                    _median([o / b for o, b in zip(runs[name], runs["builtin"])]), 3
                )
                frac, diff = _compare(last["builtin"], last[name])
                entry[f"same_tokens_fraction{suffix}"] = round(frac, 4)
                entry[f"max_logprob_diff_on_same{suffix}"] = diff
            if "ours_torch_kernels" in runs:
                frac, diff = _compare(last["ours_torch_kernels"], last["ours"])
                entry["same_tokens_fraction_vs_torch_kernels"] = round(frac, 4)
                entry["max_logprob_diff_on_same_vs_torch_kernels"] = diff
        results[key] = entry
    return results


def _bench_generate_api(ours: Ours, prompts) -> dict:
    """One VllmEngine.generate call per workload (EOS allowed: lengths vary)."""
    out = {}
    for num_prompts, n, tokens in WORKLOADS:
        t0 = time.perf_counter()
        groups = ours.engine.generate(prompts[:num_prompts], n=n, temperature=1.0, max_tokens=tokens, seed=0)
        dt = time.perf_counter() - t0
        got = sum(len(c.token_ids) for g in groups for c in g)
        out[f"{num_prompts}x{n}x{tokens}"] = {"completion_tokens": got, "tok_per_s": round(got / dt, 1)}
    return out


def _bench_push(ours: Ours, ckpt: str, repeats: int) -> dict:
    from safetensors.torch import save

    from titanrl.models.hf_checkpoint import read_state_dict

    state = read_state_dict(ckpt)
    tied = ours.engine.model_config.tie_word_embeddings
    pushed = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    num_params = sum(v.numel() for v in pushed.values())
    push, ser = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        save({k: v.contiguous() for k, v in pushed.items()})
        ser.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ours.engine.update_weights(state, version=i + 1)
        push.append(time.perf_counter() - t0)
    return {
        "num_params": num_params,
        "num_tensors": len(pushed),
        "bytes": sum(v.numel() * v.element_size() for v in pushed.values()),
        "push_seconds": [round(x, 4) for x in push],
        "median_push_seconds": round(_median(push), 4),
        "median_serialize_seconds": round(_median(ser), 4),
        "median_GB_per_s": round(sum(v.numel() * v.element_size() for v in pushed.values()) / _median(push) / 1e9, 3),
    }


def bench_size(size: str, root: Path, repeats: int, push_repeats: int, sequential: bool,
               family: str = "qwen3") -> dict:
    from titanrl.models.tiny import tiny_config, write_checkpoint

    cfg = tiny_config(family, **SIZES[size])
    ckpt = str(write_checkpoint(root / size, cfg, seed=0))
    max_num_seqs = max(p * n for p, n, _ in WORKLOADS)  # covers the largest batch
    prompts = _prompts(max(p for p, _, _ in WORKLOADS))
    result: dict = {
        "architecture": cfg.HF_ARCHITECTURE,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
                "tie_word_embeddings",
            )
        }
        | {k: getattr(cfg, k) for k in ("attention_bias", "mlp_bias") if hasattr(cfg, k)}
        | {"qkv_bias": cfg.has_qkv_bias, "rope_scaling": cfg.rope_scaling},
        "max_num_seqs": max_num_seqs,
    }
    if sequential:
        gen: dict = {}
        for cls in ARMS:
            arm = cls(ckpt, max_num_seqs)
            result[f"{arm.name}_model_class"] = _model_class(arm.llm)
            result[f"{arm.name}_start_seconds"] = round(arm.start_seconds, 2)
            part = _bench_generation({arm.name: arm.llm}, prompts, repeats, interleaved=False)
            for key, entry in part.items():
                g = gen.setdefault(key, {k: entry[k] for k in ("prompts", "n", "completion_tokens_per_call")})
                g.setdefault("tok_per_s", {}).update(entry["tok_per_s"])
                g.setdefault("median_tok_per_s", {}).update(entry["median_tok_per_s"])
                g.setdefault("median_tok_per_cpu_s", {}).update(entry["median_tok_per_cpu_s"])
            if cls is Ours:
                result["ours_module_classes"] = _module_classes(arm.llm)
                result["ours_generate_api"] = _bench_generate_api(arm, prompts)
                result["weight_push"] = _bench_push(arm, ckpt, push_repeats)
            arm.close()
        for g in gen.values():
            m = g["median_tok_per_s"]
            for name in (n for n in m if n != "builtin"):
                g[f"ratio_{name}_over_builtin"] = round(m[name] / m["builtin"], 3)
                c = g["median_tok_per_cpu_s"]
                g[f"cpu_time_ratio_{name}_over_builtin"] = round(c[name] / c["builtin"], 3)
        result["generation"] = gen
        return result

    arms = [cls(ckpt, max_num_seqs) for cls in ARMS]
    ours = arms[1]
    try:
        for arm in arms:
            result[f"{arm.name}_model_class"] = _model_class(arm.llm)
            result[f"{arm.name}_start_seconds"] = round(arm.start_seconds, 2)
        result["ours_module_classes"] = _module_classes(ours.llm)
        result["generation"] = _bench_generation(
            {arm.name: arm.llm for arm in arms}, prompts, repeats, interleaved=True
        )
        result["ours_generate_api"] = _bench_generate_api(ours, prompts)
        result["weight_push"] = _bench_push(ours, ckpt, push_repeats)
        result["weight_push_torch_kernels"] = _bench_push(arms[2], ckpt, push_repeats)
    finally:
        for arm in arms:
            arm.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    parser.add_argument("--family", default="qwen3", choices=("qwen3", "llama", "qwen2"),
                        help="model family of the checkpoints (vLLM's built-in model of it is the baseline)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per arm and workload (median reported)")
    parser.add_argument("--push-repeats", type=int, default=5)
    parser.add_argument(
        "--sequential", action="store_true", help="run builtin fully, close it, then ours (default: interleaved)"
    )
    parser.add_argument("--smoke", action="store_true", help="a check that the script runs: the tiny size, "
                        "SMOKE_WORKLOADS, --repeats 1 --push-repeats 1 (numbers mean nothing)")
    args = parser.parse_args(argv)
    if args.smoke:
        if args.out:
            parser.error("--smoke keeps no results: drop --out")
        global WORKLOADS
        WORKLOADS = SMOKE_WORKLOADS
        args.quick, args.repeats, args.push_repeats = True, 1, 1

    import torch
    import vllm
    from titanrl.kernels.cpu_build import isa_flags

    t_start = time.perf_counter()
    sizes = ["tiny"] if args.quick else list(SIZES)
    report: dict = {
        "benchmark": "rollout_engine",
        "smoke": args.smoke,
        "family": args.family,
        "cpu_flags": isa_flags(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "mode": "sequential" if args.sequential else "interleaved (both engines alive in one process)",
        "repeats": args.repeats,
        "workloads": [f"{p} prompts x n={n} x {t} tokens (ignore_eos)" for p, n, t in WORKLOADS],
        "prompt_tokens": PROMPT_LEN,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="titanrl_bench_") as tmp:
        for size in sizes:
            report["sizes"][size] = bench_size(size, Path(tmp), args.repeats, args.push_repeats, args.sequential,
                                               args.family)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)

    print(json.dumps(report), flush=True)  # one JSON line; --out keeps it indented
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
