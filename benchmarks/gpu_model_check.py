"""One-shot GPU check of batch-invariant mode at the model level: exactness and cost on CUDA.

    python benchmarks/gpu_model_check.py [--budget-s 150]
    python benchmarks/gpu_model_check.py --smoke     # the 0.5M model on the CPU (torch kernels): checks it runs

Needs torch with CUDA and Triton (no vLLM, no Ray). For a few Qwen3 sizes built with random
weights on the GPU (`titanrl.models.qwen3`, batch-invariant mode routed to the Triton kernels):

- `invariant`: every sequence's per-token logprobs (autograd on, as in training) are bitwise
  equal at batch size 1, 7 and 37 with mixed lengths, wherever the sequence sits; the same
  check with the library kernels is reported as `library_invariant`;
- `grad_max_abs_diff`: loss gradients of the batch-invariant model vs the library model;
- `train_ratio`: forward + backward time with the mode on / off on a GRPO-like batch
  (wall time around synchronized calls, interleaved repeats, median).

Prints one JSON object per line; every item runs in its own try/except and never aborts the
script; items past the time budget print {"skipped": ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
T0 = time.time()
DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()

SIZES = {
    "demo_0.5m": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=64),
    "medium_25m": dict(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "qwen3_0.6b_like": dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}


def emit(**record) -> None:
    record.setdefault("elapsed_s", round(time.time() - T0, 1))
    print(json.dumps(record, default=str), flush=True)


def build(name: str, dtype: torch.dtype):
    from titanrl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(max_position_embeddings=4096, tie_word_embeddings=True, **SIZES[name])
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config)
    model.init_weights(seed=0, std=0.05)
    return model.to(dtype), config


def logprobs(model, sequences, grad: bool):
    from titanrl import kernels
    from titanrl.trainer.grpo import token_logprobs

    fn = kernels.token_logprobs if model.batch_invariant else token_logprobs
    T = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), T, dtype=torch.long, device=DEVICE)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
    with torch.set_grad_enabled(grad):
        out = fn(model(ids[:, :-1]), ids[:, 1:])
    return [out[i, : len(s) - 1].detach() for i, s in enumerate(sequences)]


def invariance(model, vocab: int, max_len: int) -> bool:
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, vocab, (int(n),), generator=g).to(DEVICE)
            for n in torch.randint(2, max_len, (37,), generator=g)]
    alone = [logprobs(model, [s], grad=True)[0] for s in pool[:7]]
    seven = logprobs(model, pool[:7][::-1], grad=True)[::-1]
    all37 = logprobs(model, pool[30:] + pool[:30], grad=True)[7:14]
    return all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(alone, seven, all37))


def grpo_loss(model, ids, targets):
    from titanrl import kernels
    from titanrl.trainer.grpo import token_logprobs

    fn = kernels.token_logprobs if model.batch_invariant else token_logprobs
    return -fn(model(ids), targets).mean()


def check_size(name: str, dtype: torch.dtype, batch: int, seq: int, repeats: int) -> None:
    model, config = build(name, dtype)
    model.set_batch_invariant(True)
    bi_ok = invariance(model, config.vocab_size, min(seq, 300))
    model.set_batch_invariant(False)
    lib_ok = invariance(model, config.vocab_size, min(seq, 300))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g).to(DEVICE)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    grads = {}
    for flag in (False, True):
        model.set_batch_invariant(flag)
        model.zero_grad(set_to_none=True)
        grpo_loss(model, inputs, targets).backward()
        grads[flag] = [p.grad.float().clone() for p in model.parameters()]
    grad_diff = max((a - b).abs().max().item() for a, b in zip(grads[False], grads[True]))
    del grads
    times = {False: [], True: []}
    for r in range(repeats + 1):
        for flag in ((False, True) if r % 2 == 0 else (True, False)):
            model.set_batch_invariant(flag)
            model.zero_grad(set_to_none=True)
            _sync()
            t = time.perf_counter()
            grpo_loss(model, inputs, targets).backward()
            _sync()
            if r:  # the first round warms up (Triton compilation, cuBLAS heuristics)
                times[flag].append(time.perf_counter() - t)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    emit(name=name, dtype=str(dtype).removeprefix("torch."), batch=batch, seq=seq, invariant=bi_ok,
         library_invariant=lib_ok, grad_max_abs_diff=grad_diff, fwd_bwd_off_s=off, fwd_bwd_on_s=on,
         train_ratio=on / off, tokens_per_s_on=batch * seq / on)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=150)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size on the CPU, batch-invariant mode on torch's kernels instead of "
                             "Triton's: checks the script runs (timings mean nothing)")
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        emit(device="cpu", smoke=True, torch=torch.__version__)
        plan = [("demo_0.5m", torch.float32, 8, 32)]
    elif not torch.cuda.is_available():
        emit(error="no CUDA device")
        return
    else:
        emit(device=torch.cuda.get_device_name(), torch=torch.__version__)
        plan = [("demo_0.5m", torch.float32, 64, 64), ("medium_25m", torch.float32, 64, 128),
                ("medium_25m", torch.bfloat16, 64, 128), ("qwen3_0.6b_like", torch.bfloat16, 8, 1024)]
    for name, dtype, batch, seq in plan:
        if time.time() - T0 > args.budget_s:
            emit(skipped=f"{name} {dtype}", reason="time budget spent")
            continue
        try:
            check_size(name, dtype, batch, seq, args.repeats)
        except Exception as e:  # report and go on: this script cannot be debugged on the device
            emit(name=name, dtype=str(dtype), error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
