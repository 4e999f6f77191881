"""Per-rank memory of one GRPO training step, term by term, for a model shape and a layout.

Pure functions over integers: nothing here allocates a tensor. Every estimate is for the rank
that needs the most (with pipeline parallelism: the worst stage). Peak =

    resident (parameters + master weights + KL reference + gradients + optimizer state)
    + max(forward/backward transient, optimizer-step transient, checkpoint export copy)
    + process baseline

The transient of forward/backward is the stored activations of the micro-batches in flight,
the logits path, FSDP's gathered (unsharded) parameters and gradients, and the unsharded
gradients FSDP accumulates across micro-batches. Layout semantics follow the trainer:

- FSDP2 shards every parameter over dp_shard x cp (`trainer/parallel/mesh.py` fsdp_mesh);
  dp_replicate replicates (HSDP).
- tp splits attention heads, MLP columns and (vocabulary-parallel) embedding and LM head;
  norms and the MoE router stay replicated. With sequence parallel (assumed whenever tp > 1)
  the norm regions hold 1/tp of the tokens.
- pp splits the decoder layers into contiguous stages (1F1B: stage s holds pp - s
  micro-batches in flight; GPipe: all of them); the embedding sits on the first stage, the
  head on the last (a tied matrix has a copy on both).
- ep borrows its ranks from dp_shard x cp x tp (TorchTitan's rule, issue 18): experts are split
  ep ways and FSDP-sharded over the remaining dp_shard x cp x tp / ep ranks, so the world size
  is dp_replicate x dp_shard x tp x pp x cp. The trainer implements ep == tp (tp > 1) and ep
  dividing dp_shard; with tp > 1 and ep = 1 the experts are replicated over tp (FSDP over
  dp_shard x cp only).

Mixed precision (issue 17 item 3): parameters are stored in `dtype`; when that is not float32
a float32 master copy is kept; gradients and AdamW's two moments are float32; forward and
backward run in `compute_dtype` on gathered / cast copies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from titanrl.planning.shape import ModelShape
from titanrl.trainer.logprob_chunks import chunk_tokens_for

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the dtypes the trainer stores or computes in."""

CPU_PROCESS_BASELINE_BYTES = 397_100_000
"""RSS of `python -c "import torch, titanrl.trainer.trainer"` (no model, no data): measured on
this project's CPU machine class, 2026-12-01, torch 2.13.0+cpu, Python 3.11, three runs
397.08-397.18 MB. The interpreter, torch's and titanrl's modules, and the CPU kernels' libraries."""

CUDA_CONTEXT_BYTES = 1 * GiB
"""GPU memory outside PyTorch's allocator: the CUDA context, cuBLAS/NCCL workspaces and buffers.
An assumption (typically 0.5-1.5 GiB on recent GPUs and NCCL versions), not measured here; the
safety margin on top of the estimate covers allocator fragmentation."""

ActivationCheckpointing = Literal["none", "full"]
PipelineSchedule = Literal["1F1B", "GPipe"]

# Bytes autograd keeps per token of one decoder block, per element of each width: counted with
# `torch.autograd.graph.saved_tensors_hooks` over the unique storages a Qwen3 block of the shared
# decoder (titanrl/models/common/decoder.py) saves (parameters excluded), for float32 and bfloat16
# compute; tests/test_plan.py recounts them on the real module so the table and the model cannot
# drift apart. Families without per-head q/k norms save a little less (counted the same here).
#   hidden: the two RMSNorms (float32 upcast of the input, the normalized output the projections
#     read; in float32 the upcast is the input itself and x * rsqrt is kept too).
#   q (heads x head_dim): q projection, the q norm's upcast and output, the rotated halves, q after
#     rotary, k and v repeated to every query head (SDPA reads them), the attention output and
#     the output projection's (transposed, copied) input.
#   kv: k and v projections and the k norm's upcast.
#   intermediate: gate and up outputs, silu(gate), their product (the down projection's input).
#   per query head: attention's log-sum-exp and the q norm's rsqrt (float32); per kv head: the k norm's.
#   per token: the two RMSNorms' rsqrt (float32).
BLOCK_SAVED_BYTES = {
    4: dict(hidden=24, q=24, kv=8, intermediate=16, q_head=8, kv_head=4, token=8),
    2: dict(hidden=16, q=14, kv=6, intermediate=8, q_head=8, kv_head=4, token=8),
}
# Outside the blocks, per token: the final RMSNorm (hidden; the LM head's input is its output),
# the rotary cos/sin tables shared by every layer (head_dim x 2 tables) and the positions.
OUTSIDE_SAVED_BYTES = {
    4: dict(hidden=8 + 4, rotary=8, token=12),
    2: dict(hidden=6 + 2, rotary=4, token=12),
}
PACKED_SAVED_BYTES = dict(q=1, token=8)
"""Per token of one block, saved by the packed forward beyond BLOCK_SAVED_BYTES: the padded copy of
q (compute-dtype bytes per q element) and an int64 index. Counted with saved_tensors_hooks on the
packed forward against the plain one (136 bytes per token per layer at q width 32, float32);
tests/test_plan.py recounts it."""
LOGITS_COPIES = 2
"""float32 [tokens, vocab] tensors alive at once on the logits path, per chunk (the whole
micro-batch when one chunk holds it): the trainer's chunked logprobs (trainer/chunked_logprobs.py)
keep nothing of size vocab for backward and hold two such buffers at a time (the forward's logits
and their log-softmax; the backward's log p, reused for the gradient, and p). Measured with
benchmarks/trainer_memory.py at Qwen3-0.6B's shape: the full-logits arm's peak exceeds the
chunked arm's by 2.0 copies of [tokens, vocab] (3 were assumed before, a 1.29x over-estimate once
freed memory left the process: train.memory.heap_mmap_threshold_mib)."""


@dataclass(frozen=True)
class Layout:
    """A parallel layout (titanrl.config.ParallelConfig's degrees, ep borrowed from dp_shard x cp x tp)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = True
    """With tp > 1: norms and residual activations split along the sequence (no extra traffic)."""
    pp_schedule: PipelineSchedule = "1F1B"

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that take different rows of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 shards a (non-expert) parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def expert_fsdp_size(self) -> int:
        """Ranks FSDP2 shards one expert-parallel slice over: dp_shard x cp x tp / ep, where tp
        counts only when ep borrows it (ep = 1 leaves the experts replicated over tp)."""
        return self.dp_shard * self.cp * (self.tp if self.ep > 1 else 1) // self.ep

    def short(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
                 if getattr(self, name) > 1 or name == "dp_shard"]
        return " ".join(parts)

    def overrides(self) -> str:
        """The `titanrl train` overrides that select this layout."""
        out = [f"--train.parallel.{n}={getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
               if getattr(self, n) > 1]
        if self.tp > 1 and self.sequence_parallel:
            out.append("--train.parallel.sequence_parallel=true")
        if self.pp > 1:
            out.append(f"--train.parallel.pp_schedule={self.pp_schedule}")
        return " ".join(out) or "(one process: no parallel overrides)"


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes and how (train.* settings)."""

    seq_len: int
    """Tokens per sequence (prompt + completion) the step trains on."""
    batch: int
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch: int = 64
    """Sequences per forward/backward on one data-parallel rank (train.memory.micro_batch_size)."""
    dtype: str = "float32"
    """Parameter storage dtype (model.dtype)."""
    compute_dtype: str = "float32"
    """Dtype forward and backward run in (train.compute.dtype)."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """'full': every decoder block keeps only its input and recomputes the rest in backward."""
    logprob_chunk_tokens: int | None = None
    """Tokens per chunk of the LM head + log-softmax (chunked logprobs, train.memory.logprob_chunk_tokens);
    None sizes chunks as the trainer does (128 MiB of float32 logits per rank); 0 keeps full logits."""
    device: Literal["cuda", "cpu"] = "cuda"
    """cuda: AdamW runs foreach (one float32 temporary per parameter) and the CUDA context counts;
    cpu: per-parameter AdamW and the measured process baseline."""
    kl_reference: bool = False
    """train.kl.coef > 0: the trainer also holds the frozen reference policy, sharded like the
    policy, in `dtype` (no gradients, no optimizer state)."""
    lora_adapter_elements: int = 0
    """LoRA (lora.rank > 0): the adapter factors' elements, the only ones with gradients and AdamW
    state; 0: every parameter trains."""
    lora_merged_elements: int = 0
    """LoRA in the merged form (lora.sync='merged'): elements of one block's adapted weights, whose
    merged copies (compute dtype) a block recomputed under full checkpointing keeps for its
    backward (planning.fit.lora_elements)."""
    packed: bool = False
    """Micro-batches packed into one row (train.compute.pack_sequences) with attention over a padded
    copy (CPU, `titanrl.models.packed_sequences.packed_attention`): each block also keeps the padded
    queries and an index per token (PACKED_SAVED_BYTES)."""

    def __post_init__(self) -> None:
        for name in ("dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, name)!r}")
        for name in ("seq_len", "batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.logprob_chunk_tokens is not None and self.logprob_chunk_tokens < 0:
            raise ValueError(f"--logprob-chunk-tokens must be >= 0 (0: full logits), got {self.logprob_chunk_tokens}")
        if self.activation_checkpointing not in ("none", "full"):
            raise ValueError(f"--activation-checkpointing must be none or full, got {self.activation_checkpointing!r}")


@dataclass(frozen=True)
class Schedule:
    """How a data-parallel rank's rows are cut into micro-batches."""

    rows_per_rank: int
    micro_batches: int
    rows_per_micro_batch: int
    tokens_per_micro_batch: int
    """Tokens of one micro-batch on one rank: rows x seq_len / cp."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the rank that needs the most; every field is one term of the peak."""

    layout: Layout
    stage: int
    """Pipeline stage of that rank (0 without pp)."""
    schedule: Schedule
    parameter_elements: int
    """Parameter elements this rank stores (its shards)."""
    parameters: int
    """The stored shards, in `dtype`."""
    master_weights: int
    """float32 copy of the shards when `dtype` is not float32."""
    reference: int
    """The KL reference policy's shards (`Workload.kl_reference`), in `dtype`; 0 without it."""
    gradients: int
    """float32 sharded gradients (reduced in float32)."""
    optimizer_state: int
    """AdamW's exp_avg and exp_avg_sq, float32."""
    fsdp_buffers: int
    """Gathered compute-dtype parameters of the units in use and their unsharded gradients."""
    gradient_accumulation: int
    """Unsharded float32 gradients FSDP keeps across micro-batches (it reduce-scatters once, after the last)."""
    embedding_gradients: int
    """Without FSDP, from the second micro-batch on: the micro-batch's dense float32 gradients of
    the embedding and of the LM head (tied or not) exist beside the accumulated .grad before they
    are added to it. Fitted on two real runs at Qwen3-0.6B's shape (4 and 8 micro-batches): the
    trainer's step peak exceeded the other terms by 1.1-1.6 GiB; these two [vocab, hidden] copies
    are 1.16 GiB. None where both are added in place (one float32 process:
    `titanrl.models.common.grad_in_place`). (FSDP's unsharded gradients of the root unit are in
    fsdp_buffers.)"""
    activations_stored: int
    """Activations autograd keeps with no checkpointing, for the micro-batches in flight."""
    activations_checkpointed: int
    """The same with full per-block checkpointing (block inputs + one block recomputed)."""
    logits_full: int
    """Full float32 [tokens, vocab / tp] logits path."""
    logits_chunked: int
    """The same over one chunk of `logprob_chunk_tokens` tokens."""
    optimizer_step: int
    """AdamW's temporaries during the step (after activations are freed): none with the fused
    kernels the trainer uses."""
    export_copy: int
    """On CPU, saving a checkpoint gathers the full policy into one state dict in `dtype` (the HF
    export) beside everything resident: one copy of the parameters (measured at Qwen3-0.6B's shape:
    the trainer's resident memory grew 2.0 GiB in `save`, against 2.22 GiB of float32 weights). On
    a GPU the copy is in host memory, outside this estimate."""
    baseline: int
    """Process (CPU) or CUDA context (GPU) memory outside the model."""
    activation_checkpointing: ActivationCheckpointing
    chunked_logprobs: bool

    @property
    def activations(self) -> int:
        return self.activations_checkpointed if self.activation_checkpointing == "full" else self.activations_stored

    @property
    def logits(self) -> int:
        return self.logits_chunked if self.chunked_logprobs else self.logits_full

    @property
    def resident(self) -> int:
        return self.parameters + self.master_weights + self.reference + self.gradients + self.optimizer_state

    @property
    def forward_backward(self) -> int:
        return self.activations + self.logits + self.fsdp_buffers + self.gradient_accumulation + self.embedding_gradients

    @property
    def peak(self) -> int:
        return self.resident + max(self.forward_backward, self.optimizer_step, self.export_copy) + self.baseline

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(activations=self.activations, logits=self.logits, resident=self.resident,
                 forward_backward=self.forward_backward, peak=self.peak)
        return d


# ----------------------------------------------------------------------------- schedule


def schedule(layout: Layout, work: Workload) -> Schedule:
    """Rows per data-parallel rank and micro-batches, as GRPOStep cuts them."""
    rows = -(-work.batch // layout.dp)  # zero-mask rows pad the batch to a multiple of dp
    n_micro = -(-rows // work.micro_batch)
    if layout.pp > 1:  # the pipeline wants at least pp micro-batches, a multiple of pp
        n_micro = -(-max(n_micro, layout.pp) // layout.pp) * layout.pp
    rows_mb = -(-rows // n_micro)
    return Schedule(rows, n_micro, rows_mb, rows_mb * work.seq_len // layout.cp)


def in_flight(layout: Layout, n_micro: int, stage: int) -> int:
    """Micro-batches whose activations a pipeline stage holds at once."""
    if layout.pp == 1:
        return 1
    if layout.pp_schedule == "GPipe":
        return n_micro
    return min(layout.pp - stage, n_micro)  # 1F1B: warm-up depth of this stage


def stage_layers(shape: ModelShape, layout: Layout, stage: int) -> range:
    per = shape.num_hidden_layers // layout.pp
    return range(stage * per, (stage + 1) * per)


def stage_holds(layout: Layout, stage: int) -> tuple[bool, bool]:
    """(embedding, LM head + final norm) on this stage: the first and the last."""
    return stage == 0, stage == layout.pp - 1


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class StageParams:
    """Parameter elements of one stage, by how they shard."""

    tp_split: int
    """Split by tp (projections, dense MLPs, vocabulary-parallel embedding and head), then by FSDP."""
    replicated: int
    """Replicated under tp (norms, router), sharded by FSDP."""
    expert_elements: int
    """Expert weights, split ep ways and FSDP-sharded over dp_shard x cp x tp / ep."""
    root: int
    """Of tp_split + replicated: the outer FSDP unit (embedding, final norm, head)."""
    largest_layer: int
    """The largest decoder layer (one FSDP unit), tp- and ep-split, unsharded."""


def stage_params(shape: ModelShape, layout: Layout, stage: int) -> StageParams:
    s, tp, ep = shape, layout.tp, layout.ep
    has_embedding, has_head = stage_holds(layout, stage)
    tp_split = replicated = experts = 0
    largest = 0
    for i in stage_layers(shape, layout, stage):
        layer_tp = s.attention_projection_params
        layer_rep = s.layer_norm_params
        layer_exp = 0
        if s.is_sparse_layer(i):
            layer_rep += s.router_params
            layer_exp = s.expert_params
        else:
            layer_tp += s.dense_mlp_params
        tp_split += layer_tp
        replicated += layer_rep
        experts += layer_exp
        largest = max(largest, layer_tp // tp + layer_rep + layer_exp // ep)
    root = 0
    if has_embedding:
        tp_split += s.embedding_params
        root += s.embedding_params // tp
    if has_head:
        replicated += s.hidden_size  # final norm
        root += s.hidden_size
        if not s.tie_word_embeddings or layout.pp > 1:  # an untied head, or the tied matrix's last-stage copy
            tp_split += s.embedding_params
            root += s.embedding_params // tp
    return StageParams(tp_split, replicated, experts, root, largest)


def rank_parameter_elements(p: StageParams, layout: Layout) -> int:
    """Elements this rank stores: each group's share, rounded up (FSDP pads uneven shards)."""
    dense = -(-p.tp_split // (layout.tp * layout.fsdp_size)) + -(-p.replicated // layout.fsdp_size)
    experts = -(-p.expert_elements // (layout.ep * layout.expert_fsdp_size)) if p.expert_elements else 0
    return dense + experts


# ----------------------------------------------------------------------------- activations


def block_saved_bytes(shape: ModelShape, layer: int, compute_bytes: int, tokens: int, layout: Layout) -> int:
    """Bytes autograd keeps for one decoder block over `tokens` tokens on one rank.

    tp splits heads and MLP columns; the hidden-sized terms (norms) are split only with
    sequence parallel, which then all-gathers the full-sequence input of the attention and
    MLP projections (two [tokens, hidden] tensors they keep). A sparse layer's MLP terms are
    replaced by the router's (float32 upcast of its input, float32 scores, top-k) and, per
    routed copy of a token, the expert SwiGLU's terms plus the dispatched input and the expert
    output the combine weighs (balanced routing assumed; under ep the copies move between ranks
    but their number per rank stays tokens x top-k).
    """
    c, s, tp = BLOCK_SAVED_BYTES[compute_bytes], shape, layout.tp
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    sp = layout.sequence_parallel and tp > 1
    hidden = c["hidden"] * s.hidden_size // (tp if sp else 1) + (2 * compute_bytes * s.hidden_size if sp else 0)
    per_token = (
        hidden
        + (c["q"] * q + c["kv"] * kv + c["q_head"] * s.num_attention_heads + c["kv_head"] * s.num_key_value_heads) // tp
        + c["token"]
    )
    if s.is_sparse_layer(layer):
        k = s.num_experts_per_tok
        router = 4 * s.hidden_size + 4 * s.num_experts + 16 * k  # fp32 input, fp32 scores, top-k values/ids/weights
        experts = k * (c["intermediate"] * s.moe_intermediate_size + 2 * compute_bytes * s.hidden_size)
        # Under tp the MoE block sees the sequence-parallel 1/tp of the tokens (experts are not tp-split).
        per_token_moe = (router + experts) // (tp if sp else 1)
        return tokens * (per_token + per_token_moe)
    return tokens * (per_token + c["intermediate"] * s.intermediate_size // tp)


def outside_saved_bytes(shape: ModelShape, compute_bytes: int, tokens: int, has_head: bool, layout: Layout) -> int:
    """Per micro-batch outside the blocks: rotary tables on every stage; the final norm on the last."""
    c = OUTSIDE_SAVED_BYTES[compute_bytes]
    per_token = c["rotary"] * shape.head_dim + c["token"]
    if has_head:
        per_token += c["hidden"] * shape.hidden_size
    return tokens * per_token


def stage_activations(shape: ModelShape, layout: Layout, work: Workload, stage: int, sched: Schedule
                      ) -> tuple[int, int]:
    """(stored, checkpointed) activation bytes of a stage, its in-flight micro-batches included."""
    b = DTYPE_BYTES[work.compute_dtype]
    T = sched.tokens_per_micro_batch
    flights = in_flight(layout, sched.micro_batches, stage)
    layers = stage_layers(shape, layout, stage)
    _, has_head = stage_holds(layout, stage)
    outside = outside_saved_bytes(shape, b, T, has_head, layout)
    blocks = [block_saved_bytes(shape, i, b, T, layout) for i in layers]
    if work.packed:
        q = shape.num_attention_heads * shape.head_dim // layout.tp
        blocks = [block + T * (PACKED_SAVED_BYTES["q"] * b * q + PACKED_SAVED_BYTES["token"]) for block in blocks]
    stored = flights * (sum(blocks) + outside)
    # Checkpointed: each block keeps its input [tokens, hidden] (1/tp of it with sequence
    # parallel); backward recomputes one block at a time, whose saved tensors then exist once.
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    block_inputs = len(layers) * T * b * shape.hidden_size // sp
    checkpointed = flights * (block_inputs + outside) + max(blocks, default=0)
    return stored, checkpointed


def logits_bytes(shape: ModelShape, layout: Layout, work: Workload, sched: Schedule, stage: int) -> tuple[int, int]:
    """(full, chunked) bytes of the logits path on a stage that holds the head (0 elsewhere).

    Full: LOGITS_COPIES float32 [tokens, vocab / tp] tensors (vocabulary-parallel under tp:
    each rank holds its vocabulary shard and a log-sum-exp over shards). A pipeline stage keeps
    the log-softmax of every micro-batch in flight. Chunked: the same copies of one chunk; the
    chunk's logits are recomputed in backward, so nothing of size vocab outlives it.
    """
    _, has_head = stage_holds(layout, stage)
    if not has_head:
        return 0, 0
    vocab = -(-shape.vocab_size // layout.tp)
    T = sched.tokens_per_micro_batch
    flights = in_flight(layout, sched.micro_batches, stage)
    full = 4 * T * vocab * (LOGITS_COPIES - 1 + flights)
    chunk = min(chunk_tokens_for(vocab, work.logprob_chunk_tokens or None), T)
    return full, 4 * chunk * vocab * LOGITS_COPIES


# ----------------------------------------------------------------------------- the estimate


def estimate_stage(shape: ModelShape, layout: Layout, work: Workload, stage: int) -> MemoryEstimate:
    """Every term for one rank of pipeline stage `stage`."""
    b, store = DTYPE_BYTES[work.compute_dtype], DTYPE_BYTES[work.dtype]
    sched = schedule(layout, work)
    p = stage_params(shape, layout, stage)
    n = rank_parameter_elements(p, layout)
    sharded = layout.fsdp_size > 1 or layout.expert_fsdp_size > 1
    cast = work.compute_dtype != work.dtype
    # FSDP working set: the root unit stays gathered through forward and backward, a layer and
    # its prefetched successor are gathered at a time (compute dtype); backward makes the
    # unsharded gradient of the root and one layer (compute dtype, plus its float32 cast for
    # the reduce-scatter). A single process without a cast uses its parameters in place.
    fsdp = 0
    if sharded or cast:
        fsdp = (p.root + 2 * p.largest_layer) * b + (p.root + p.largest_layer) * (b + (4 if b != 4 else 0))
    accumulation = 0
    if sharded and sched.micro_batches > 1:
        unsharded = -(-p.tp_split // layout.tp) + p.replicated + -(-p.expert_elements // layout.ep)
        accumulation = 4 * (work.lora_adapter_elements or unsharded)  # LoRA: only the adapters have gradients
    embedding_gradients = 0
    if not sharded and sched.micro_batches > 1 and any(stage_holds(layout, stage)):
        in_place = layout.world_size == 1 and not cast and b == 4  # titanrl.models.common.grad_in_place
        embedding_gradients = 0 if in_place else 2 * 4 * -(-shape.vocab_size // layout.tp) * shape.hidden_size
    stored, checkpointed = stage_activations(shape, layout, work, stage, sched)
    # Full checkpointing: a recomputed block keeps its merged weights for its backward (without
    # checkpointing each lives through its matmul alone: lora.recompute_merged_weights).
    checkpointed += b * work.lora_merged_elements
    # LoRA: only the adapters train, FSDP-sharded like every parameter (tp splits one factor of each
    # and replicates the other: not divided here, a slight overestimate of a small term).
    trained = -(-work.lora_adapter_elements // layout.fsdp_size) if work.lora_adapter_elements else n
    full, chunked = logits_bytes(shape, layout, work, sched, stage)
    # Fused AdamW (titanrl.trainer.optimizer.implementation) updates each tensor in place: no
    # temporaries beyond a few scalars. (Only a layout mixing DTensors and plain tensors falls back
    # to the per-parameter loop, two float32 temporaries of one parameter: small next to the rest.)
    step = 0
    baseline = CUDA_CONTEXT_BYTES if work.device == "cuda" else CPU_PROCESS_BASELINE_BYTES
    return MemoryEstimate(
        layout=layout, stage=stage, schedule=sched, parameter_elements=n,
        parameters=store * n,
        master_weights=4 * n if store != 4 else 0,
        reference=store * n if work.kl_reference else 0,
        gradients=4 * trained,
        optimizer_state=8 * trained,
        fsdp_buffers=fsdp,
        gradient_accumulation=accumulation,
        embedding_gradients=embedding_gradients,
        activations_stored=stored,
        activations_checkpointed=checkpointed,
        logits_full=full,
        logits_chunked=chunked,
        optimizer_step=step,
        export_copy=store * shape.total_params if work.device == "cpu" else 0,
        baseline=baseline,
        activation_checkpointing=work.activation_checkpointing,
        chunked_logprobs=work.logprob_chunk_tokens != 0,
    )


def estimate(shape: ModelShape, layout: Layout, work: Workload) -> MemoryEstimate:
    """The estimate of the rank with the highest peak (the worst pipeline stage)."""
    return max((estimate_stage(shape, layout, work, s) for s in range(layout.pp)), key=lambda e: e.peak)


def estimate_cpu_process(shape: ModelShape, work: Workload) -> MemoryEstimate:
    """One trainer process on CPU (the layout of world size 1): what `benchmarks/trainer_memory.py`
    compares with a measured peak RSS. Includes CPU_PROCESS_BASELINE_BYTES."""
    return estimate(shape, Layout(), replace(work, device="cpu"))


__all__ = [
    "GiB", "DTYPE_BYTES", "CPU_PROCESS_BASELINE_BYTES", "Layout", "Workload", "Schedule", "MemoryEstimate",
    "estimate", "estimate_stage", "estimate_cpu_process",
]
