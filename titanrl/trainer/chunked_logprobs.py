"""LM head + log-softmax + target gather over chunks of tokens, so full-vocabulary logits never exist.

`chunked_token_logprobs(hidden_ND, weight_VD, targets_N, ...)` returns each token's log p(target)
and the entropy of its sampling distribution softmax(logits / temperature), both float32 [N].
The forward computes one chunk of `chunk_tokens` rows of logits at a time and keeps only per-token
numbers (log-sum-exp, entropy); the backward recomputes each chunk's logits and accumulates the
gradients of the hidden states and the head weight, from either output (a loss on the logprobs,
an entropy bonus). Peak extra memory is two or three [chunk_tokens, V] float32 buffers (reused
in place) instead of [N, V] logits plus their autograd copies; the backward recomputes the
logits (one more matmul). benchmarks/chunked_logprobs.py measures both.

Batch-invariant mode computes a chunk's logits with `kernels.linear` and its logprobs with
`kernels.token_logprobs`: both give a row the same bits whatever rows share the call, so the
chunked logprobs are bitwise those of the unchunked batch-invariant path.

Vocabulary parallel (`vocab_group`): `weight_VD` is this rank's contiguous shard of the head,
rows [vocab_start, vocab_start + V_local), shards possibly uneven (259 = 130 + 129). Each rank
computes its shard's logits per chunk; the log-sum-exp (max, then sum of exp), the target logit
(from the rank that owns the target id) and the entropy's sum of p * z are combined with
all-reduces over the group; the backward all-reduces the hidden states' gradient. No rank holds
full-vocabulary logits.

Truncated sampling (`truncation`, rollout.sampling.top_k / top_p with rollout.sampling.logprobs='sampled'): each
token's log p is z_y - logsumexp(z over the kept set) and the entropy is the truncated
distribution's, where the kept set is decided per chunk on the same float32 scaled logits z as
vLLM decides it (`titanrl.trainer.truncation.kept_mask`, no gradient; the gradient flows through
the kept logits). A target outside the trainer's kept set (possible once the weights differ from
the generator's, or on prompt positions) is added to it: its log p is renormalised over
kept + {target}, finite, and `outside_N` (if given) marks it. The backward recomputes the chunk's
logits with the forward's kernels (same bits) and rebuilds the same kept set from two saved
numbers per token (the smallest kept value; whether the sort split its ties, then that row alone
is decided again), so only the forward sorts. The sort behind top-p adds about three
[chunk_tokens, V] buffers (sorted values, int64 order) per chunk and dominates the head's time
on CPU at Qwen's vocabulary (benchmarks/chunked_logprobs.py --truncations); top-k alone does not
sort. Not available over vocabulary shards (config validation refuses tp > 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanrl import kernels
from titanrl.models.common.grad_in_place import grad_accumulates_in_place, holds_gradient
from titanrl.trainer.truncation import Truncation, kept_mask


def _logits(hidden: torch.Tensor, weight: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """One chunk's logits in float32 (computed in the parameters' dtype, as the unchunked head does)."""
    logits = kernels.linear(hidden, weight) if batch_invariant else hidden @ weight.t()
    return logits if logits.dtype == torch.float64 else logits.float()


def _local_stats(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, group: dist.ProcessGroup
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vocabulary-parallel log-sum-exp, target logit and entropy of scaled logits z [c, V_local]."""
    top = z.max(-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = (z - top[:, None]).exp()
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[-1])
    target_z = torch.where(owned, z.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1), 0.0)
    sums = torch.stack([shifted.sum(-1), (shifted * z).sum(-1), target_z])
    dist.all_reduce(sums, group=group)
    exp_sum, exp_z_sum, target_z = sums.unbind(0)
    lse = top + exp_sum.log()
    # H = lse - E_p[z]
    return target_z - lse, lse - exp_z_sum / exp_sum, lse


def _vocab_shard(weight: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """This rank's rows of a vocabulary-sharded head, the group over its shards, its first id."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise ValueError(f"a DTensor LM head must be sharded on rows over a 1-D mesh, got {weight.placements} "
                         f"on {mesh}")
    local = weight.to_local()  # differentiable: the gradient comes back as the same Shard(0) DTensor
    # Shard(0) splits as torch.chunk does: ceil(V / n) rows per rank, the last ranks fewer (uneven).
    start = min(mesh.get_local_rank() * -(-weight.shape[0] // mesh.size()), weight.shape[0])
    if not local.shape[0] or start + local.shape[0] > weight.shape[0]:
        raise ValueError(f"vocabulary shard of {local.shape[0]} rows at {start} does not fit {weight.shape[0]}")
    return local, mesh.get_group(), start


def _kept_with_targets(z: torch.Tensor, targets: torch.Tensor, truncation: Truncation
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's kept set of each row of z [c, V] plus the row's target; which targets it lacked; and
    per row the smallest kept value and whether the sort split that value's ties (some dropped)."""
    kept = kept_mask(z, truncation)
    low = z.masked_fill(~kept, float("inf")).amin(-1)
    split = ((z == low[:, None]) & ~kept).any(-1)
    outside = ~kept.gather(-1, targets[:, None]).squeeze(-1)
    kept.scatter_(-1, targets[:, None], True)
    return kept, outside, low, split


def _kept_again(z: torch.Tensor, targets: torch.Tensor, low: torch.Tensor, split: torch.Tensor,
                truncation: Truncation) -> torch.Tensor:
    """The forward's kept set (+ targets) of the same z, without sorting again: every value >= the
    row's smallest kept one, except in rows whose ties at that value the sort split (decided anew)."""
    kept = z >= low[:, None]
    rows = split.nonzero().squeeze(-1)
    if rows.numel():
        kept[rows] = kept_mask(z[rows], truncation)
    return kept.scatter_(-1, targets[:, None], True)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """Autograd Function behind `chunked_token_logprobs` (saves hidden, weight, targets, lse, entropy)."""

    @staticmethod
    def forward(ctx, hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,  # noqa: ANN001
                temperature: float, chunk_tokens: int, batch_invariant: bool,
                vocab_group: dist.ProcessGroup | None, vocab_start: int, truncation: Truncation | None,
                outside_N: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        N = hidden_ND.shape[0]
        out_dtype = torch.float64 if hidden_ND.dtype == torch.float64 else torch.float32
        logprobs, entropy, lse = (torch.empty(N, dtype=out_dtype, device=hidden_ND.device) for _ in range(3))
        # Truncation: what the backward needs to rebuild each row's kept set without a sort.
        low = torch.empty(N if truncation is not None else 0, dtype=out_dtype, device=hidden_ND.device)
        split = torch.empty(low.shape, dtype=torch.bool, device=hidden_ND.device)
        for lo in range(0, N, chunk_tokens):
            hi = min(lo + chunk_tokens, N)
            # Fresh [c, V] buffers, reused in place: at most three exist at once.
            logits = _logits(hidden_ND[lo:hi], weight_VD, batch_invariant)
            if truncation is not None:
                z = logits.div_(temperature).contiguous()  # vLLM's float32 logits / temperature, bitwise
                kept, outside, low[lo:hi], split[lo:hi] = _kept_with_targets(z, targets_N[lo:hi], truncation)
                if outside_N is not None:
                    outside_N[lo:hi] = outside
                masked = z.masked_fill_(~kept, float("-inf"))
                # vLLM's processed logprobs: log_softmax of the masked row.
                logp = kernels.log_softmax(masked) if batch_invariant else torch.log_softmax(masked, -1)
                logprobs[lo:hi] = logp.gather(-1, targets_N[lo:hi, None]).squeeze(-1)
                top = logp.argmax(-1, keepdim=True)  # always a kept token
                lse[lo:hi] = (masked.gather(-1, top) - logp.gather(-1, top)).squeeze(-1)
                del logits, z, masked
                entropy[lo:hi] = -logp.exp().mul_(logp.masked_fill_(~kept, 0.0)).sum(-1)
                del logp, kept
            elif vocab_group is None:
                # The unchunked reference's ops, row for row (same bits in batch-invariant mode).
                if batch_invariant:
                    logprobs[lo:hi] = kernels.token_logprobs(logits, targets_N[lo:hi], temperature)
                    logp = kernels.log_softmax(logits, temperature)
                    z = logits.div_(temperature)
                else:
                    z = logits.div_(temperature) if temperature != 1.0 else logits  # == logits / T, bitwise
                    logp = torch.log_softmax(z, -1)
                    logprobs[lo:hi] = logp.gather(-1, targets_N[lo:hi, None]).squeeze(-1)
                # log-sum-exp = z - log p at the row's largest logit, where log p is near 0 (precise).
                top = z.argmax(-1, keepdim=True)
                lse[lo:hi] = (z.gather(-1, top) - logp.gather(-1, top)).squeeze(-1)
                del logits, z
                entropy[lo:hi] = -logp.exp().mul_(logp).sum(-1)
                del logp
            else:
                logprobs[lo:hi], entropy[lo:hi], lse[lo:hi] = _local_stats(
                    logits.div_(temperature), targets_N[lo:hi], vocab_start, vocab_group)
                del logits
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse, entropy, low, split)
        ctx.temperature, ctx.chunk_tokens, ctx.batch_invariant = temperature, chunk_tokens, batch_invariant
        ctx.vocab_group, ctx.vocab_start, ctx.truncation = vocab_group, vocab_start, truncation
        ctx.weight_param = weight_VD if grad_accumulates_in_place(weight_VD, vocab_group) else None
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):  # noqa: ANN001, ANN205
        hidden, weight, targets, lse, entropy, low, split = ctx.saved_tensors
        T, group = ctx.temperature, ctx.vocab_group
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        param = ctx.weight_param
        in_place = (need_weight and holds_gradient(param, weight)
                    and (grad_logprobs is not None or grad_entropy is not None))
        # Accumulated over chunks in at least float32, cast to the weight's dtype once; or added
        # to the gradient the Parameter already holds (`grad_accumulates_in_place`).
        grad_weight = (param.grad if in_place else
                       torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                   device=weight.device) if need_weight else None)
        if grad_logprobs is None and grad_entropy is None:
            return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), *[None] * 8
        V_local = weight.shape[0]
        for lo in range(0, hidden.shape[0], ctx.chunk_tokens):
            hi = min(lo + ctx.chunk_tokens, hidden.shape[0])
            h = hidden[lo:hi]
            # Two [c, V] buffers: log p (then the gradient) and p.
            if ctx.truncation is None:
                logp = _logits(h, weight, False).div_(T).sub_(lse[lo:hi, None])
                p = logp.exp()
            else:
                # The forward's kernels give the forward's bits, hence its kept set; p is 0 outside it.
                z = _logits(h, weight, ctx.batch_invariant).div_(T).contiguous()
                kept = _kept_again(z, targets[lo:hi], low[lo:hi], split[lo:hi], ctx.truncation)
                logp = z.sub_(lse[lo:hi, None])
                p = logp.exp().masked_fill_(~kept, 0.0)
                del kept
            if grad_entropy is not None:
                # dH/dz = -p (log p + H), built in log p's buffer
                grad_z = logp.add_(entropy[lo:hi, None]).mul_(p).mul_(-grad_entropy[lo:hi, None])
                if grad_logprobs is not None:
                    grad_z.sub_(p.mul_(grad_logprobs[lo:hi, None]))
            else:
                grad_z = p.mul_(-grad_logprobs[lo:hi, None])  # d log p(t) / dz = onehot(t) - p
            del logp, p
            if grad_logprobs is not None:
                g = grad_logprobs[lo:hi]
                local = targets[lo:hi] - ctx.vocab_start
                owned = (local >= 0) & (local < V_local)
                grad_z.scatter_add_(-1, local.clamp(0, V_local - 1)[:, None], (g * owned)[:, None].to(grad_z.dtype))
            grad_logits = grad_z.div_(T).to(weight.dtype)
            del grad_z
            if need_hidden:
                grad_hidden[lo:hi] = (grad_logits @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
        if need_hidden and group is not None:
            # Each rank holds its vocabulary shard's share of d(loss)/d(hidden).
            dist.all_reduce(grad_hidden, group=group)
        if in_place or grad_weight is None:
            return grad_hidden, None, *[None] * 8
        return grad_hidden, grad_weight.to(weight.dtype), *[None] * 8


def chunked_token_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                           temperature: float = 1.0, chunk_tokens: int = 1024, batch_invariant: bool = False,
                           vocab_group: dist.ProcessGroup | None = None, vocab_start: int = 0,
                           truncation: Truncation | None = None, outside_N: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy under softmax(hidden @ weight.T / temperature), chunk by chunk.

    hidden_ND: final-norm hidden states of N tokens (a plain tensor, whole on every vocabulary
    rank); weight_VD: the LM head, or this rank's vocabulary shard of it (rows from id
    `vocab_start`, combined over `vocab_group`), or a DTensor sharded on rows over a 1-D mesh
    (vocabulary parallel, group and start taken from it); targets_N: token ids. truncation: score
    under the generator's top-k / top-p truncated, renormalised distribution instead (None or
    inactive: the full softmax); outside_N: a bool [N] tensor to fill with whether each target
    was outside the kept set (it is then scored over kept + {target}). Returns float32 [N]
    logprobs and entropies (float64 for float64 inputs).
    """
    if truncation is not None and not truncation.active:
        truncation = None
    if outside_N is not None:
        outside_N.zero_()
    if isinstance(weight_VD, DTensor):
        weight_VD, vocab_group, vocab_start = _vocab_shard(weight_VD)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if batch_invariant and vocab_group is not None:
        raise ValueError("batch-invariant logprobs cannot be computed from vocabulary shards")
    if truncation is not None and vocab_group is not None:
        raise ValueError("top-k / top-p truncated logprobs cannot be computed from vocabulary shards")
    return ChunkedTokenLogprobs.apply(hidden_ND, weight_VD, targets_N.long(), float(temperature), int(chunk_tokens),
                                      bool(batch_invariant), vocab_group, int(vocab_start), truncation, outside_N)
