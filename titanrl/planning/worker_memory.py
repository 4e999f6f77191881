"""Host memory of one vLLM rollout worker on CPU, term by term (pure arithmetic, like `memory`).

    peak = baseline + weights + packed copies + KV cache + sampler buffers

- baseline: the process with vLLM's engine started on a tiny model (interpreter, torch, vLLM,
  the engine's own state), measured;
- weights: the policy in the generator dtype. Before the first push they are the checkpoint's,
  loaded into the worker; a shared-memory push then maps the pushed version in their place
  (zero-copy), so the worker holds one copy either way. A push's second copy (the version
  being written while the worker still reads the last one) is the transport's, counted per
  node by `titanrl.planning.fit`, not here;
- packed copies: with vLLM's CPU kernels (rollout.engine.vllm_kernels, outside batch-invariant
  mode) every linear layer's weight also lives in oneDNN's packed layout; a push repacks layer by
  layer, so only one layer's old copy exists at once next to the new ones;
- KV cache: rollout.engine.kv_cache_gib, allocated (and zeroed) at start-up;
- sampler buffers: [max_num_seqs, vocab] float32 logits and the copies sampling makes of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titanrl.planning.memory import DTYPE_BYTES, GiB
from titanrl.planning.shape import ModelShape

WORKER_BASELINE_BYTES = int(1.23 * GiB)
"""Peak RSS of a rollout worker on the arithmetic example's 0.4M-parameter model minus its 1 GiB
KV cache (`memory/worker_peak_gib` 2.23-2.24 GiB in two runs, 2026-12-06, 2-core AVX-512 EPYC,
vLLM 0.32 CPU, in-process engine): the interpreter, torch, vLLM and the engine's state."""

SAMPLER_LOGIT_COPIES = 1.6
"""[max_num_seqs, vocab] float32 tensors' worth the engine keeps for sampling (logits and what
sampling derives from them), sized by the start-up dummy run at full width. Fitted on one run: at
Qwen3-0.6B's shape (151,936-token vocabulary, max_num_seqs 512) the worker's RSS exceeded the
other terms by 0.46 GiB, 1.6 such tensors."""


@dataclass(frozen=True)
class WorkerEstimate:
    """Bytes of one rollout worker's peak resident memory, by term."""

    baseline: int
    weights: int
    packed: int
    kv_cache: int
    sampler: int

    @property
    def peak(self) -> int:
        return self.baseline + self.weights + self.packed + self.kv_cache + self.sampler

    def as_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def kv_bytes_per_token(shape: ModelShape, dtype: str) -> int:
    """KV-cache bytes one token takes over every layer: a key and a value per KV head."""
    return 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * DTYPE_BYTES[dtype]


def linear_weight_elements(shape: ModelShape) -> int:
    """Elements of the decoder's linear layers (what vLLM's CPU kernels pack): everything but the
    embedding, the untied LM head and the norms. Expert weights stay unpacked (their kernels
    read the Parameters)."""
    return sum(shape.attention_projection_params + (shape.dense_mlp_params if not shape.is_sparse_layer(i) else 0)
               for i in range(shape.num_hidden_layers))


def estimate_worker(shape: ModelShape, *, dtype: str, kv_cache_bytes: int, max_num_seqs: int,
                    vllm_kernels: bool) -> WorkerEstimate:
    """One CPU rollout worker's peak. `dtype`: the generator dtype; `vllm_kernels`: whether its
    linear layers run on packed copies (rollout.engine.vllm_kernels outside batch-invariant mode)."""
    b = DTYPE_BYTES[dtype]
    return WorkerEstimate(
        baseline=WORKER_BASELINE_BYTES,
        weights=b * shape.total_params,
        packed=b * linear_weight_elements(shape) if vllm_kernels else 0,
        kv_cache=kv_cache_bytes,
        sampler=int(SAMPLER_LOGIT_COPIES * 4 * max_num_seqs * shape.vocab_size),
    )
