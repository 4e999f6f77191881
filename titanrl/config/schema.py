"""Typed run configuration: the dataclasses, and nothing else (it imports only the table of renamed keys).

Every field has a docstring saying why it exists (`titanrl train --help` shows them: tyro reads
them, see `help`). A setting with a fixed set of values is a `Literal` type: the CLI offers
those as choices and `validation` refuses anything else. CLI-style `section.key=value`
overrides are parsed in `overrides`; `validation` checks a whole config before any actor starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from titanrl.config.renamed import refuses_renamed

Dtype = Literal["float32", "bfloat16"]
"""Floating dtypes of parameters (model.dtype) and of compute (train.compute.dtype)."""
Device = Literal["auto", "cpu", "cuda", "xla"]
"""Trainer devices: 'auto' is CUDA when present, else CPU; 'xla' runs the trainer in the XLA venv."""
WeightTransport = Literal["auto", "object_store", "shared_memory", "broadcast"]
"""How new weights reach the rollout workers."""
PPSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B"]
"""Pipeline schedules (config/parallel.py knows how many stages each runs per rank)."""
ActivationCheckpointing = Literal["none", "full", "every_nth"]
"""Which decoder blocks recompute their activations in backward instead of storing them."""
Auto = Literal["auto"]
"""A memory setting resolved from the run's memory plan before any actor starts (titanrl/planning/fit.py)."""
ActivationCheckpointingSetting = Literal["auto", "none", "full", "every_nth"]
"""train.memory.activation_checkpointing: a mode, or 'auto' (chosen by the memory plan)."""
CpuMatmul = Literal["auto", "mkl", "onednn"]
"""Which library runs the CPU trainer's float32 linear layers (train.compute.cpu_matmul)."""
MoeLoadBalance = Literal["aux_loss", "bias", "none"]
"""How a mixture-of-experts policy's expert load is balanced (train.moe.load_balance)."""
KlEstimator = Literal["k1", "k2", "k3"]
"""Schulman's sample estimators of KL(pi || pi_ref) (train.kl.estimator)."""
PolicyLoss = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
"""Policy-gradient objectives (train.loss.objective; titanrl/trainer/losses)."""
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How per-token losses are averaged over a (mini)batch (train.loss.aggregation)."""
OffPolicyCorrection = Literal["none", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "mis_geometric"]
"""Importance corrections for the generator-vs-trainer mismatch (train.off_policy.correction)."""
RewardFn = Callable[..., float]
"""A reward `(prompt, completion, **row_fields) -> float`."""


@dataclass
class ModelConfig:
    """Which policy to start from."""

    checkpoint: str = ""
    """HF checkpoint directory (config.json, safetensors, tokenizer) of the initial policy."""
    dtype: Dtype = "float32"
    """Storage dtype: the trainer's parameters (master weights), gradients, optimizer state,
    training checkpoints and HF exports. The trainer and the generators (vLLM) compute in it too
    unless train.compute.dtype is set. float32 with train.compute.dtype=bfloat16 is mixed
    precision (GPU); float32 alone is the fast choice on CPUs without bf16 units (AVX2)."""


@dataclass
class DataConfig:
    """Prompts to train and evaluate on."""

    train_file: str = ""
    """Training rows: a .jsonl, .json, .parquet or .csv file (or a glob of them), or a directory
    written by `datasets.Dataset.save_to_disk`; each row has `prompt_field` (or `messages_field`)
    plus any fields the reward needs."""
    eval_file: str = ""
    """Held-out rows for eval accuracy, in the forms `train_file` takes; empty disables eval."""
    prompt_field: str = "prompt"
    """Row key holding the prompt text."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of the training rows."""
    on_overlong: Literal["drop", "error"] = "drop"
    """Rows whose prompt tokens + rollout.sampling.max_new_tokens exceed rollout.engine.max_model_len: 'drop' them
    (one warning with the count and first index) or 'error' before any actor starts."""
    messages_field: str = ""
    """Row key holding chat messages (a list of {"role", "content"}, or a string: one user message)
    to render with the checkpoint tokenizer's chat template (ChatML when it has none) into
    `prompt_field`; empty: rows hold prompt text."""
    train_rows: Any = None
    """Training rows in memory (a list of dicts or a `datasets.Dataset`), used instead of
    `train_file`; Python only (config.json records their count, not their contents)."""
    eval_rows: Any = None
    """Held-out rows in memory (a list of dicts or a `datasets.Dataset`), used instead of `eval_file`."""
    system_prompt: str = ""
    """With `messages_field`: a system message put before each row's messages (unless they start
    with one), e.g. the answer format a reward expects."""


@dataclass
class SamplingConfig:
    """How tokens are sampled."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scores tokens under the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (vLLM's top_p); 1.0: off. Under rollout.sampling.logprobs='sampled' the trainer
    scores tokens under the same truncated distribution."""
    top_k: int = 0
    """Sample among the k most likely tokens (vLLM's top_k, applied before top_p); 0: off."""
    max_new_tokens: int = 32
    """Token limit per completion."""
    logprobs: Literal["sampled", "raw"] = "sampled"
    """Which distribution both sides score tokens under when top_k or top_p truncates sampling.
    'sampled': the truncated, renormalised distribution the generator sampled from (vLLM's
    processed logprobs; the trainer applies the same top-k/top-p to its own logits), so the PPO
    ratio is 1 at equal weights. 'raw': the full softmax at the sampling temperature, ignoring the
    truncation (vLLM's raw_logprobs, taken before temperature: with top_k or top_p on it needs
    rollout.sampling.temperature=1). Without truncation both choices are the same full softmax."""


@dataclass
class EngineConfig:
    """Each worker's vLLM engine."""

    max_model_len: int = 512
    """Longest prompt + completion the engine accepts."""
    max_num_seqs: int = 256
    """Sequences the engine batches at once; should cover prompts_per_step * group_size."""
    kv_cache_gib: float | Auto = "auto"
    """KV-cache memory per engine on CPU (VLLM_CPU_KVCACHE_SPACE, whole GiB, at least 1). 'auto'
    (resolved from the memory plan before start-up): room for the worker's share of a step's
    sequences at max_model_len tokens each; less, down to what one max_model_len sequence needs,
    only when the node's memory cannot hold the run otherwise (fewer sequences run at once)."""
    multiprocess: bool = False
    """Run vLLM's engine core in its own process (slower start on CPU, isolates crashes)."""
    vllm_kernels: bool | Auto = "auto"
    """On CPU, outside batch-invariant mode, run the model's linear layers and rotary through
    vLLM's own kernels (oneDNN on prepacked weights): faster generation, but every weight push
    repacks (~4 memory copies' time of the model per worker, measured) and the packed copies take
    the linear weights' memory once more. False: torch's kernels on the Parameters themselves, so
    a zero-copy shared-memory push costs the trainer's one copy. 'auto' (resolved from the memory
    plan before start-up): on, unless the node's memory needs the packed copies' room."""
    threads: int = 1
    """Intra-op threads of each worker; 1 is robust on a busy 2-core machine."""
    record_routed_experts: bool | None = None
    """Record the experts the generator routed every token through (Sample.routed_experts, which
    router replay trains on); None: on for mixture-of-experts checkpoints, off for dense ones.
    True needs a mixture-of-experts model.checkpoint."""


@dataclass
class ShapingConfig:
    """DAPO's dynamic sampling and overlong shaping."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (lock-step rollouts only): a step's groups whose rewards are all equal
    (no learning signal) are replaced by groups of fresh prompts, generated as extra requests of
    prompts_per_step prompts each, until the step has prompts_per_step groups with unequal rewards
    or dynamic_sampling_max_requests extra requests were made (then the dropped groups fill the rest)."""
    dynamic_sampling_max_requests: int = 4
    """Extra generation requests per step that dynamic_sampling may make before it gives up."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: samples that did not finish (hit max_new_tokens, or an episode its
    budget) get no loss (their loss mask is zeroed); they still count in their group's baseline."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a completion of L tokens with L > max_new_tokens - overlong_buffer
    gets overlong_penalty * (max_new_tokens - overlong_buffer - L) / overlong_buffer added to its
    reward (-overlong_penalty at max_new_tokens); 0 turns it off. Single-turn rollouts only."""
    overlong_penalty: float = 1.0
    """The soft overlong penalty at max_new_tokens (its scale); see overlong_buffer."""


@refuses_renamed("rollout.")
@dataclass
class RolloutConfig:
    """How completions are generated."""

    num_workers: int = 1
    """Rollout worker actors, each owning one vLLM engine."""
    prompts_per_step: int = 32
    """Prompts per optimizer step; each yields `group_size` completions."""
    group_size: int = 8
    """Completions per prompt; GRPO compares them to each other."""
    continuous: bool = False
    """Workers generate group by group, without waiting for the trainer, into a trajectory buffer
    (`titanrl.driver.sources.buffer`) that admits a group only while it can be trained within train.max_staleness
    versions, and take new weights between engine steps (partial rollouts; Sample.token_versions).
    Off: each step's prompts go to the workers as one fixed batch per worker, which makes a run
    reproducible to the bit even without batch_invariant."""
    elastic: bool = False
    """Continuous mode on a Ray cluster: num_workers is the starting count; a worker is added (at the
    current weight version) for each node that joins with room for one, and dropped when its node is
    lost (the others take its groups), mid-run. Logged as rollout/workers (docs/multinode.md)."""
    on_weight_update: Literal["continue", "regenerate"] = "continue"
    """Continuous mode, when new weights arrive while requests are running: 'continue' keeps their
    tokens and recomputes their KV cache with the new weights (each token keeps the version that
    sampled it); 'regenerate' aborts unfinished groups and generates them again from scratch."""
    defer_weight_loads: bool = True
    """Continuous mode, 'continue': a new version waits between engine steps until no request is
    running, or until loading it lets at least as many requests that wait for it start (in free
    `max_num_seqs` slots) as it recomputes (a recompute is one more prefill of each running
    request); False: it lands at the next step boundary."""
    weight_transport: WeightTransport = "auto"
    """How new weights reach the workers: 'object_store' (Ray's object store), 'shared_memory'
    (one shared-memory copy read by every worker of the machine) or 'broadcast' (a
    torch.distributed group from the trainer to the workers: gloo on CPU, NCCL on GPU). 'auto':
    shared_memory when the driver started Ray on this machine, the engines run on CPU and
    /dev/shm holds four versions of the model; object_store otherwise
    (`titanrl.driver.weight_transport`)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature, truncation and length of completions."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Each worker's vLLM engine: lengths, batch, KV cache, threads, kernels."""
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    """DAPO's dynamic sampling and overlong filtering and penalty."""


@dataclass
class ParallelConfig:
    """How the trainer's processes split the work; the product of the degrees but ep is its world size."""

    dp_replicate: int = 1
    """Data-parallel replicas holding full copies (HSDP's outer dimension when dp_shard > 1)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2)."""
    tp: int = 1
    """Tensor-parallel degree: attention heads and MLP columns split across ranks."""
    sequence_parallel: bool = False
    """With tp > 1, also shard norms and activations along the sequence between TP regions."""
    pp: int = 1
    """Pipeline stages: the decoder layers split into consecutive stages."""
    pp_schedule: PPSchedule = "1F1B"
    """Pipeline schedule: 'GPipe', '1F1B' or 'Interleaved1F1B' (two stages per rank)."""
    cp: int = 1
    """Context-parallel degree: each sequence split across ranks, attention as a ring."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model: each sparse layer's experts split over
    ep ranks borrowed from the others (it does not multiply the world size): the tp ranks when
    tp > 1 (ep == tp, with sequence_parallel), else ep neighbouring dp_shard ranks (ep divides
    dp_shard). Tokens travel to their experts' ranks and back by all-to-all; the expert weights
    are FSDP-sharded over the dp_shard / ep (x dp_replicate) ranks holding the same experts; the
    router is replicated. ep must divide num_experts; cp > 1 and pp > 1 are not combined with it."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp


@dataclass
class OptimizerConfig:
    """AdamW and gradient clipping."""

    lr: float = 1e-4
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay of the weight matrices (an untied LM head included); norm
    gains, biases and the embedding (with a tied head) are never decayed: the
    optimizer's 'no_decay' param group."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping."""


@dataclass
class LrScheduleConfig:
    """The learning rate over the run."""

    warmup_steps: int = 0
    """Linear learning-rate warm-up steps."""
    decay: Literal["constant", "cosine"] = "constant"
    """After warm-up: 'constant', or 'cosine' down to min_lr_ratio * lr at the last step."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of lr under cosine decay."""


@dataclass
class LossConfig:
    """The policy-gradient objective."""

    objective: PolicyLoss = "grpo"
    """Policy objective. 'grpo': PPO-clip per token on group-normalised advantages (DeepSeekMath,
    Shao et al. 2024). 'dr_grpo': the same clip with no std scaling of advantages and no length
    normalisation: per-token losses summed and divided by (sequences x length_norm), a
    constant (Dr. GRPO, "Understanding R1-Zero-Like Training", Liu et al. 2025). 'dapo': the clip
    with clip-higher (clip_eps_high defaults to 0.28) and token-mean aggregation (DAPO, Yu et al.
    2025; its dynamic sampling and overlong shaping are rollout-side settings). 'gspo': one ratio
    per sequence, exp(mean of its tokens' log-ratios), clipped by gspo_clip_eps (GSPO, "Group
    Sequence Policy Optimization", Zheng et al. 2025). 'cispo': no token is clipped out; each
    token's gradient A * grad log p is weighted by its ratio truncated at 1 + clip_eps_high
    (default 0.28), a stop-gradient constant (CISPO, MiniMax-M1, 2025)."""
    clip_eps: float = 0.2
    """PPO clip range below 1 (and above, unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None means clip_eps."""
    scale_advantages_by_std: bool | None = None
    """Divide group-centered rewards by the group std (GRPO); False gives Dr.GRPO-style centering.
    None: True, except with train.loss.objective='dr_grpo' (which never scales by the std)."""
    aggregation: LossAggregation | None = None
    """How per-token losses average over the (mini)batch: 'token-mean' (every trained token alike),
    'seq-mean-token-mean' (mean over each sequence's tokens, then over sequences),
    'seq-mean-token-sum-norm' (each sequence's token sum divided by length_norm, then mean over
    sequences). None: the loss's own (token-mean; seq-mean-token-mean for gspo;
    seq-mean-token-sum-norm for dr_grpo, the only one dr_grpo accepts). Weights come from the whole
    batch, so micro-batching and parallel layouts do not change the result."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this times the (aggregated) entropy of the trainer's sampling
    distribution on the trained tokens; 0 disables it."""
    gspo_clip_eps: tuple[float, float] = (3e-4, 4e-4)
    """objective='gspo': clip range (below, above) 1 of the sequence ratio; GSPO's paper uses 3e-4 and
    4e-4 (sequence ratios sit much closer to 1 than token ratios)."""
    length_norm: int | None = None
    """The constant of 'seq-mean-token-sum-norm' (dr_grpo): a sequence's token sum is divided by it.
    None: rollout.sampling.max_new_tokens (env.max_total_tokens for environment runs)."""


@dataclass
class KlConfig:
    """The KL penalty towards the initial policy."""

    coef: float = 0.0
    """Weight of the KL penalty towards a frozen reference policy, the run's initial weights
    (model.checkpoint; after a resume still the first run's). 0 (the default): no penalty, and no
    reference is held (no memory, no forward). > 0 holds the reference on the trainer's device,
    sharded like the policy, and costs one no-grad forward of it per step; the pipelined trainer
    (train.parallel.pp > 1) has none."""
    estimator: KlEstimator = "k3"
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi, with r = pi_ref / pi of
    the token: 'k1' = -log r (unbiased, can be negative), 'k2' = (log r)^2 / 2 (biased, >= 0;
    as a loss its gradient is the reverse KL's on-policy), 'k3' = r - 1 - log r (unbiased,
    >= 0; as a loss its gradient is the forward KL(pi_ref || pi)'s on-policy; GRPO's choice)."""
    in_reward: bool = False
    """True: fold the KL into the reward, as PPO-RLHF does: each sample's reward loses coef x
    its completion's summed token KL (estimated from the generator's logprobs) before the
    advantages are computed, and the loss has no KL term. False: add coef x the token-mean
    KL (from the trainer's logprobs, with its gradient) to the loss."""


@dataclass
class OffPolicyConfig:
    """Corrections for samples the trainer's weights did not generate."""

    decoupled_loss: bool = False
    """Clip the PPO ratio around the trainer's weights before the update (the proximal policy) and
    weight each token by pi_prox / pi_generator (truncated at behaviour_weight_cap), as AReaL does
    for stale samples. On-policy it equals plain PPO-clip; with max_staleness >= 1 it keeps stale
    tokens from being clipped away. The trust region then acts only from a step's second
    minibatch or epoch on: with minibatches=ppo_epochs=1 a step is as unbounded as on-policy
    GRPO, so use an lr that is stable on-policy (or minibatches > 1). Costs one no-grad forward
    with minibatches or ppo_epochs > 1."""
    behaviour_weight_cap: float = 2.0
    """Truncation of the decoupled loss's importance weight pi_prox / pi_generator."""
    correction: OffPolicyCorrection = "none"
    """Correction for generator-vs-trainer mismatch by the ratio w = pi_trainer / pi_generator of
    the trainer's weights at the start of the batch (no gradient); the policy ratio is then taken
    around those weights, as decoupled_loss does. 'tis_token' / 'tis_sequence': truncated
    importance sampling, each token's loss times min(w, cap), w per token or the
    product over the sequence ("Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training", Yao et al. 2025). 'mis_token' / 'mis_sequence': masked importance sampling, the
    weight w where it lies in [low, cap] and 0 (token or sequence dropped)
    outside; 'mis_geometric': sequences whose geometric-mean ratio lies outside are dropped, the
    others kept with weight 1 ("When Speed Kills Stability", Liu et al. 2025). Not with
    decoupled_loss (which is 'tis_token' at behaviour_weight_cap). Costs one no-grad forward with
    minibatches or ppo_epochs > 1, which only a single trainer process runs."""
    cap: float = 2.0
    """Upper bound of the off-policy ratio: the truncation of 'tis_*', the mask bound of 'mis_*'."""
    low: float | None = None
    """Lower bound of the off-policy ratio for 'mis_*' (below it a token or sequence is dropped);
    None: 1 / cap."""


@dataclass
class MoeConfig:
    """Mixture-of-experts training: router replay and load balancing (dense policies ignore it)."""

    router_replay: bool = False
    """Mixture-of-experts policies: route each trained token through the experts the generator
    chose for it (`Sample.routed_experts`; unrecorded tokens are routed live), while the combine
    weights still come from the trainer's own router scores, so the router keeps its gradient.
    Removes routing disagreement from the train/inference mismatch. One process, dp_replicate,
    dp_shard and cp layouts (the recorded experts are sharded like the tokens); tp and pp are
    refused."""
    load_balance: MoeLoadBalance = "none"
    """Mixture-of-experts policies: 'aux_loss' adds HF's Switch-style load-balancing loss times
    aux_loss_coef to the GRPO loss; 'bias' is auxiliary-loss-free balancing (DeepSeek-V3):
    a per-expert bias, added to the router scores for the top-k choice only, moves by
    bias_update_rate towards balance after each optimizer step (saved in training
    checkpoints, pushed to the generators); 'none' (the default, as transformers trains Qwen3-MoE
    unless config.json sets output_router_logits) does neither: the gradient is then the same
    under every layout. Dense policies ignore it.
    The auxiliary loss is computed per micro-batch (its own load statistics, over the tokens up to
    each row's last trained one, through the experts the forward used) and weighted by the
    micro-batch's share of those tokens in the whole batch: HF's value on a batch that is one
    micro-batch, so it depends on how the batch is split into micro-batches and ranks. It is
    reported as moe/aux_loss (whatever this setting), not in `loss`."""
    aux_loss_coef: float | None = None
    """Weight of the auxiliary loss with load_balance='aux_loss'; None: the model's
    config.json router_aux_loss_coef."""
    bias_update_rate: float = 1e-3
    """With load_balance='bias': the step each expert's bias takes per optimizer step, up
    for an expert below the mean load and down for one above it."""


@dataclass
class ComputeConfig:
    """Where and how the trainer computes: device, dtype, threads, kernels."""

    device: Device = "auto"
    """Trainer device: 'auto' (CUDA when present, else CPU), 'cpu', 'cuda', or 'xla' (torch_xla: TPU,
    or XLA's CPU device; the trainer actor runs under train.compute.xla_python, the rollout workers stay)."""
    dtype: Dtype | None = None
    """float32, bfloat16 or None (model.dtype): the dtype the trainer's forward/backward and the
    generators (vLLM) compute in. bfloat16 with model.dtype=float32 is mixed precision: each
    forward runs on a bf16 cast of the float32 weights, gradients reach them (and are reduced
    across ranks) in float32, and the optimizer state stays float32 (FSDP2's
    MixedPrecisionPolicy; the same policy without FSDP). The generators get the same bf16
    weights. Use it on GPUs (bf16 tensor cores); on CPUs without bf16 units leave it None
    (float32 is faster there). Wider than model.dtype is refused; batch_invariant needs float32."""
    threads: int = 1
    """Intra-op threads of the trainer process (while a rollout worker is generating, when
    threads_when_rollouts_idle is set)."""
    threads_when_rollouts_idle: int | None = None
    """Intra-op threads of the trainer while no rollout worker is generating; None: always
    `threads`. With max_staleness >= 1 the trainer overlaps generation, and each worker waits for
    the next weights once its batch is done: set `threads` to the cores the workers leave free and
    this to all the cores, so the trainer takes the idle workers' cores without oversubscribing
    them while they sample (it checks before each decoder layer; titanrl.trainer.idle_cores).
    2-core CPU, issue 21's 19M run (benchmarks/vs_trl.py): 8.8 s per step against 9.2 s with
    threads=2, whose trainer threads slowed generation from 4.8 to 6.1 s; with train.compute.compile
    7.42 s against 7.49 s (the trainer bounds the step either way). Single-process CPU
    trainer on the workers' machine (ray_address unset); not with batch_invariant (the thread
    count changes float rounding, so the trainer's numbers would depend on timing)."""
    cpu_matmul: CpuMatmul = "auto"
    """Library for the single-process CPU trainer's float32 linear layers outside batch_invariant:
    'mkl' (torch's default), 'onednn' (torch's mkldnn ops for the forward and input-gradient GEMMs;
    1.2-2x MKL's on an AMD EPYC with AVX-512, where MKL keeps to its AVX2 kernels), or 'auto'
    (onednn on AMD CPUs with AVX-512, mkl elsewhere and wherever onednn cannot run)."""
    compile: bool = False
    """Compile each decoder block with torch.compile (inductor, symbolic sizes): RMSNorm, rotary and
    SiLU-and-mul chains become fused loops, forward and backward (1.2x a 19M model's CPU step, see
    benchmarks/trainer_step.py). The first step pays the compile (~20 s on a CPU; a C++ compiler
    is needed there). Not with batch_invariant (its own kernels), train.compute.device='xla' (compiled
    anyway), or a parallel layout (not yet checked: one trainer process only)."""
    pack_sequences: bool = True
    """Pack each micro-batch's samples end to end into one row of only their real tokens (those up
    to the last trained target), so no projection, norm or MLP computes padding; attention keeps
    the samples apart (titanrl/models/packed_sequences.py). Results equal the padded forward's
    (bitwise in batch-invariant mode). Applies where the layout allows: not with pp > 1, cp > 1
    or on XLA (fixed shape buckets), which stay right-padded."""
    share_prompts: bool = True
    """With pack_sequences: samples of a micro-batch that start with the same prompt (a GRPO
    group's) compute it once; attention reads its keys and values from that one copy, and the
    gradients of every sample meet there. Equal to computing each sample's prompt (bitwise in
    batch-invariant mode); ~40 % fewer tokens on the arithmetic example's 8-sample groups."""
    xla_python: str = ""
    """train.compute.device='xla': the Python interpreter of the XLA environment (torch_xla pins its own
    torch, so the trainer actor runs there); empty: .venv-xla/bin/python in the current directory or
    the titanrl checkout (`make xla-venv` builds it)."""


@dataclass
class MemoryConfig:
    """What the trainer holds at once: micro-batches, logit chunks, activations, heap."""

    micro_batch_size: int | Auto = "auto"
    """Sequences per forward/backward; gradients accumulate to one step per batch. 'auto' (resolved
    from the memory plan before start-up, with activation_checkpointing): the fastest setting that
    fits the node, that is a data-parallel rank's whole batch in one micro-batch when it fits, else
    the largest power of two that does; 64 for a trainer built by hand, with no plan."""
    logprob_chunk_tokens: int | None = None
    """Tokens whose LM-head logits exist at once: the head, log-softmax and its backward run over
    chunks of this many tokens (logits recomputed in backward), so a micro-batch never holds its
    full [tokens, vocab] logits. None (the default): as many tokens as fit 128 MiB of float32 logits
    (220 at Qwen3's 151,936-token vocabulary; a tiny vocabulary's micro-batch is one chunk). A
    chunk's backward holds ~3 such buffers; smaller saves memory, at a little speed."""
    activation_checkpointing: ActivationCheckpointingSetting = "auto"
    """Decoder blocks that keep only their input for backward and recompute the rest there
    (saves activation memory for about one more forward): 'none', 'full' (every block) or
    'every_nth' (every activation_checkpointing_every-th block). Gradients are unchanged. 'auto'
    (resolved from the memory plan before start-up): 'none' when some micro-batch size fits the
    node without it, else 'full'; 'none' for a trainer built by hand, with no plan."""
    activation_checkpointing_every: int = 2
    """With activation_checkpointing='every_nth': checkpoint blocks N, 2N, ... (1-based), N >= 1."""
    heap_mmap_threshold_mib: int | None = None
    """Host allocations of at least this many MiB get pages of their own from the kernel and give
    them back when freed (glibc's M_MMAP_THRESHOLD, set in each trainer process). None (auto): 1
    for models of 100M parameters or more, 32 below (titanrl.memory.auto_heap_mmap_threshold_mib).
    Low keeps memory down: glibc's own threshold rises to 32 MiB as large blocks are freed, after
    which freed tensors stay in its heap, fragmented; at Qwen3-0.6B's shape that held ~2.3 GiB of
    resident memory no tensor used (trainer peak 12.15 GiB vs 9.88 GiB with 4), and micro-batches
    of 4 sequences fragmented 1.1 GiB more below 4 MiB (12.72 GiB at 4, 11.66 at 1). High keeps small
    models fast: each allocation above the threshold is faulted in page by page and unmapped when
    freed; the 19M model's step takes 1.33x as long at 4 as at 32 (benchmarks/heap_threshold.py).
    0 leaves glibc's behaviour (and the MALLOC_MMAP_THRESHOLD_ environment variable) alone; no
    effect off glibc."""


@refuses_renamed("train.")
@dataclass
class TrainConfig:
    """The GRPO optimization."""

    steps: int = 100
    """Optimizer steps (one per rollout batch)."""
    max_staleness: int = 0
    """Oldest policy version the trainer accepts, in steps behind; 0 is synchronous on-policy."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (PPO-style); >1 lets the clip bound on-policy updates."""
    minibatches: int = 1
    """Optimizer steps per pass: the batch's groups are split into this many minibatches."""
    max_skipped_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient norm (each skipped) that stop the run."""
    auto_resume: bool = False
    """When the trainer's actor dies (its node lost), resume from the newest checkpoint in the same
    run, once the cluster has room again (within cluster.placement_timeout_s), up to
    AUTO_RESUME_ATTEMPTS times; needs output.save_every_steps >= 1. False: the run stops, saved."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW's settings and gradient clipping."""
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    """Warm-up and decay of the learning rate."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy objective, clipping, advantage scaling and aggregation."""
    kl: KlConfig = field(default_factory=KlConfig)
    """KL penalty towards the initial policy (off by default)."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Decoupled loss and importance corrections for stale or mismatched samples."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Router replay and load balancing of mixture-of-experts policies."""
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """Device, compute dtype, threads, kernels and the packed forward."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Micro-batch size, logit chunks, activation checkpointing and the heap threshold."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer's processes (FSDP2, HSDP, TP/SP, PP, CP, EP)."""


@dataclass
class EvalConfig:
    """Held-out greedy accuracy."""

    every_steps: int = 10
    """Evaluate before step 1, every this many steps, and after the last; 0 disables."""
    max_prompts: int = 200
    """Evaluate on at most this many rows of the eval file."""
    max_new_tokens: int = 0
    """Token limit for eval completions; 0 means rollout.sampling.max_new_tokens."""
    correct_threshold: float = 1.0
    """A greedy completion counts as correct when its summed reward is at least this."""


@dataclass
class OutputConfig:
    """What lands in the run directory."""

    dir: str = ""
    """Run directory for metrics, TensorBoard events, plots, rollouts, checkpoints; empty: runs/<timestamp>.
    It must not already hold a run (nothing written before is ever overwritten)."""
    save_every_steps: int = 0
    """Write a full training checkpoint (for exact `--resume`) every this many steps; 0: only the
    final HF policy and the checkpoint written when a run stops early."""
    rollouts_per_step: int = 4
    """Sample groups per step written to rollouts.jsonl."""
    progress_bar: bool = True
    """Show a tqdm progress bar on stderr."""
    tensorboard: bool = True
    """Write TensorBoard event files next to metrics.jsonl."""
    wandb_project: str = ""
    """Weights & Biases project that the driver mirrors each step's metrics and the config to (needs
    `pip install 'titanrl[wandb]'`); empty: no W&B. metrics.jsonl stays the record: a W&B failure
    warns once and the run goes on without it."""
    wandb_entity: str = ""
    """W&B user or team owning `wandb_project`; empty: the logged-in account's default entity."""
    wandb_run_name: str = ""
    """Display name of the W&B run; empty: the run directory's name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """online streams to the W&B server; offline needs no network and keeps the W&B run under
    RUN_DIR/wandb/ (upload it later with `wandb sync RUN_DIR/wandb/offline-run-*`); disabled skips W&B."""


@dataclass
class EnvConfig:
    """Multi-turn environments: set `factory` to turn rollouts into episodes."""

    factory: Callable[..., Any] | str | None = None
    """Environment factory `make_env(context) -> titanrl.envs.Environment` (or 'module:function');
    None means single-turn completions scored by `rewards`. With an env, `rewards` are optional
    and add to the episode's own reward."""
    max_turns: int = 4
    """Model turns per episode before it is cut off."""
    max_total_tokens: int = 512
    """Completion-side tokens per episode (model turns + inserted observations)."""
    sandbox_pool_size: int = 4
    """Pre-warmed code sandboxes per rollout worker (0: environments get no sandbox pool)."""


@dataclass
class AgentConfig:
    """Agents written against the OpenAI API: set `fn` to train an unchanged harness.

    Each rollout worker serves `POST /v1/chat/completions` and `POST /v1/completions` on
    127.0.0.1 from its own engine; an episode is one call of `fn`, and every call it makes is
    recorded token for token (titanrl/agents: the rule that turns calls into samples)."""

    fn: Callable[..., Any] | str | None = None
    """`agent(base_url, api_key, row) -> float` (sync or async, or 'module:function'): runs one
    episode with any OpenAI client against `base_url` (with `api_key` as its bearer token) and
    returns the episode's reward. None: no agent (single-turn completions or `env`)."""
    timeout_s: float = 300.0
    """Wall-clock limit of one episode: past it the episode is a reward error
    (scoring.error_value) and the endpoint refuses its later calls."""
    max_calls: int = 16
    """Endpoint calls one episode may make (each choice of an n > 1 call counts); later calls get HTTP 429."""
    chat_template: str | None = None
    """Path of a Jinja chat template used instead of the checkpoint tokenizer's (as vLLM's
    --chat-template); it must render `tools` and assistant `tool_calls` for tool-using agents."""
    served_model_name: str = "policy"
    """The `model` a request must name (the policy being trained); any other name gets HTTP 404."""
    sandbox_pool_size: int = 0
    """Pre-warmed code sandboxes per rollout worker that agents reach through
    `titanrl.agents.episode_sandbox()` (0: none)."""
    max_request_bytes: int = 1_000_000
    """Largest request body the endpoint reads; a larger one gets HTTP 413."""


@dataclass
class LoraConfig:
    """Low-rank adapters: train rank-r matrices beside frozen base weights (docs/lora.md)."""

    rank: int = 0
    """Rank r of every adapter (A is r x in, B is out x r); 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """Scale numerator: a linear computes with W + (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input; only 0 is built: the generators run without it, so the
    trainer's log-probabilities would no longer be theirs (and the merged form has no place for it)."""
    target_modules: list[str] | None = None
    """Leaf names of the linears that get adapters, as the family spec's `lora_targets` spells them; None: every
    linear of the attention and MLP blocks, as the model family's spec names them."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What a weight push sends, and so how the trainer computes. 'adapter': the adapter factors
    alone (well under 1 % of the weights); trainer and workers compute x W^T + (alpha / rank) *
    (x A^T) B^T beside the frozen base with the same matmuls, so a push lands with no merge and
    batch-invariant parity stays exact. 'merged': full weights W + (alpha / rank) * B @ A under the
    base names, which the trainer computes with too, for generators that should hold plain weights,
    and faster where the rank is a large part of a small model's hidden size (the unmerged term
    costs ~2 * rank / hidden of each linear; docs/lora.md)."""


@dataclass
class ClusterConfig:
    """Where a run's actors go on a Ray cluster: which nodes take the trainer and which the rollout
    workers (titanrl/driver/placement.py; docs/multinode.md)."""

    trainer_resource: str | None = None
    """A custom Ray resource each trainer rank takes 1 of: start the trainer's nodes with
    `ray start --resources='{"titanrl_trainer": 8}'` (8 ranks fit there) and set this to
    'titanrl_trainer'. None: the trainer goes wherever it fits."""
    worker_resource: str | None = None
    """The same for rollout workers (1 per worker), e.g. 'titanrl_rollout'. None: anywhere."""
    reserve_cpus: bool = False
    """Reserve each actor's threads as Ray CPUs (train.compute.threads per rank,
    rollout.engine.threads per worker), which spreads a CPU cluster by capacity; False reserves a
    token, so one machine holds the trainer and every worker."""
    placement_timeout_s: float = 60.0
    """How long start-up waits for resources that exist but are taken (by other jobs), and how long
    a replacement rollout worker waits for capacity after a node is lost."""


@dataclass
class RewardHealthConfig:
    """Per-step checks that the rewards still carry a learning signal and are not being gamed."""

    agreement_pairs: list[str] = field(default_factory=list)
    """Pairs of reward names 'a:b' that should agree (e.g. 'format:exact_match'): each step logs
    reward/agreement/a_vs_b, the fraction of samples scored by both where both are > 0 or both are <= 0."""
    hacking_window: int = 1
    """Evaluations back that the reward-hacking check compares with (see hacking_reward_rise)."""
    hacking_reward_rise: float = 0.2
    """Reward-hacking check, at each evaluation k: R_k is the mean of reward/<name>/mean over the
    training steps since evaluation k-1. When R_k - R_{k-w} >= this (w = hacking_window) while
    eval/accuracy rose by less than hacking_accuracy_rise, reward/<name>/hacking_suspected is 1
    and a warning is logged (once when the flag turns on); 0 turns the check off."""
    hacking_accuracy_rise: float = 0.02
    """Rise of eval/accuracy over the same evaluations below which a reward's rise counts as suspect."""


@dataclass
class ScoringConfig:
    """How rewards are run: concurrency, timeouts, errors and health checks."""

    concurrency: int = 16
    """How many sync reward calls run at once per worker (its helper threads); async rewards of
    all samples are awaited together regardless. 1 (with timeout_s=None) calls sync
    rewards one after another in the worker's own thread."""
    timeout_s: float | None = 60.0
    """A reward call (one sample) running longer than this gets `error_value`; None: no limit."""
    error_value: float = 0.0
    """Reward given to a sample whose reward function raised, timed out or returned a non-finite number."""
    max_error_frac: float = 0.5
    """A step where more than this fraction of samples had reward errors stops the run (after a checkpoint)."""
    health: RewardHealthConfig = field(default_factory=RewardHealthConfig)
    """Reward agreement pairs and the reward-hacking check."""


@refuses_renamed("")
@dataclass
class RunConfig:
    """A whole GRPO run: `titanrl.train(RunConfig(...))`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Initial policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Train and eval prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation settings."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer and loss settings."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Run directory contents."""
    rewards: list[RewardFn | str] = field(default_factory=list)
    """Reward callables `(prompt, completion, **row_fields) -> float` (or 'module:function' strings;
    sync or async; `@titanrl.batched_reward` ones take lists); summed, weighted by reward_weights."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn environment, episode budgets and sandbox pool size."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """An OpenAI-client agent trained through the rollout workers' endpoint (instead of `env`)."""
    seed: int = 0
    """Seed of sampling and of anything random in the trainer."""
    batch_invariant: bool = False
    """Trainer and generators compute every op with `titanrl.kernels`, so the generator's logprobs
    equal the trainer's bit for bit (parity/logprob_diff_max is 0) and runs are bitwise reproducible;
    False uses the faster library kernels."""
    ray_address: str | None = None
    """Address of an existing Ray cluster to join (e.g. '10.0.0.1:6379' or 'auto'); None starts a
    local single-machine Ray on loopback."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Which Ray nodes take the trainer and which the rollout workers."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per entry of `rewards`, in order: a sample's reward is the weighted sum; empty: all 1.
    Metrics (reward/<name>/mean) show each reward's own, unweighted value."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """Reward concurrency, timeouts, error handling and health checks."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (lora.rank > 0)."""

    @property
    def runs_episodes(self) -> bool:
        """Whether rollouts are episodes whose prompts the environment or the agent writes (not the data)."""
        return self.env.factory is not None or self.agent.fn is not None

    @property
    def calls_per_episode(self) -> int:
        """Model calls one sample can be made of (what its seed range covers): env.max_turns,
        agent.max_calls, or 1 for single-turn completions."""
        if self.agent.fn is not None:
            return self.agent.max_calls
        return self.env.max_turns if self.env.factory is not None else 1

    @property
    def generator_dtype(self) -> Dtype:
        """The dtype rollout workers run vLLM in and receive weights in: the trainer's compute dtype."""
        return compute_dtype(self.model, self.train)


def compute_dtype(model: ModelConfig, train: TrainConfig) -> Dtype:
    """The trainer's (and the generators') compute dtype: train.compute.dtype, else model.dtype."""
    return train.compute.dtype or model.dtype
