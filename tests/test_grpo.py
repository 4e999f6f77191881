"""GRPO math (advantages, clipped surrogate, temperature logprobs), `pack`, and GRPOTrainer steps."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from titanrl.config import LrScheduleConfig, MemoryConfig, ModelConfig, OffPolicyConfig, OptimizerConfig, TrainConfig
from titanrl.models.hf_checkpoint import load_model
from titanrl.trainer.grpo import clipped_surrogate_loss, group_advantages, token_logprobs
from titanrl.trainer.batch import pack
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample
from titanrl.trainer.setup import TrainerSetup

# ----------------------------------------------------------------------------- group_advantages


def test_group_advantages_zero_mean_unit_std():
    """Advantages of a mixed group have mean 0 and (population) std 1, in reward order."""
    r = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0])
    a = group_advantages(r)
    assert abs(a.mean().item()) < 1e-6
    assert a.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    mean, std = statistics.fmean(r.tolist()), statistics.pstdev(r.tolist())
    expected = [(x - mean) / (std + 1e-6) for x in r.tolist()]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_advantages_without_std_scaling_only_centers():
    """scale_by_std=False (Dr.GRPO) subtracts the group mean and nothing else."""
    r = torch.tensor([3.0, 1.0, 2.0, 6.0])
    assert group_advantages(r, scale_by_std=False).tolist() == pytest.approx([0.0, -2.0, -1.0, 3.0])


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.3, 0.7, 1 / 3, -2.5])
@pytest.mark.parametrize("n", [2, 3, 6, 7, 8])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_group_advantages_all_equal_exactly_zero(value, n, scale_by_std):
    """A group whose rewards are all equal gets exactly zero advantages (no 0/eps rounding noise),
    also for rewards such as 0.1 or 0.3 whose float32 mean is not exactly the value."""
    a = group_advantages(torch.full((n,), value), scale_by_std=scale_by_std)
    assert torch.equal(a, torch.zeros(n)), a


# ----------------------------------------------------------------------------- clipped surrogate


def _loss(logp, old, adv, mask=None, eps=0.2, high=None):
    logp = torch.tensor(logp, dtype=torch.float32).reshape(1, -1).requires_grad_(True)
    old = torch.tensor(old, dtype=torch.float32).reshape(1, -1)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float32).reshape(1, -1)
    loss, stats = clipped_surrogate_loss(logp, old, torch.tensor([adv]), mask, eps, high)
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), stats


def test_surrogate_ratio_one_is_minus_advantage_per_token():
    """At ratio 1 the summed loss is -A times the number of masked tokens; d loss/d logp = -A."""
    loss, grad, stats = _loss([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], 0.75)
    assert loss == pytest.approx(-0.75 * 3)
    assert grad == pytest.approx([-0.75, -0.75, -0.75])
    assert stats["clipped_tokens"].item() == 0


def test_surrogate_mask_excludes_tokens():
    """Masked-out tokens contribute neither loss nor gradient, whatever their logprobs."""
    loss, grad, stats = _loss([-1.0, 5.0, -0.5, -9.0], [-1.0, -3.0, -0.5, 0.0], 2.0, mask=[1, 0, 1, 0])
    assert loss == pytest.approx(-2.0 * 2)
    assert grad == pytest.approx([-2.0, 0.0, -2.0, 0.0])
    assert stats["max_abs_logprob_diff"].item() == 0.0  # only masked tokens differ


def test_surrogate_positive_advantage_pushes_logprob_up():
    """Gradient descent on the loss raises the logprob of positive-advantage tokens and lowers negatives."""
    _, grad_pos, _ = _loss([-1.0], [-1.1], 1.0)
    _, grad_neg, _ = _loss([-1.0], [-1.1], -1.0)
    assert grad_pos[0] < 0  # -grad points up
    assert grad_neg[0] > 0


@pytest.mark.parametrize(
    "ratio, adv, clipped_ratio, has_grad",
    [
        (1.5, 1.0, 1.2, False),  # A>0, ratio above 1+eps: clipped, no incentive to go higher
        (0.5, 1.0, 0.5, True),  # A>0, ratio below 1-eps: unclipped (pessimistic bound)
        (0.5, -1.0, 0.8, False),  # A<0, ratio below 1-eps: clipped
        (1.5, -1.0, 1.5, True),  # A<0, ratio above 1+eps: unclipped
        (1.1, 1.0, 1.1, True),  # inside the range: unclipped either way
        (0.9, -1.0, 0.9, True),
    ],
)
def test_surrogate_clips_only_in_ppo_direction(ratio, adv, clipped_ratio, has_grad):
    """PPO-clip: min(r*A, clip(r)*A) clips only when moving further in the advantage's direction."""
    old = -1.0
    loss, grad, _ = _loss([old + math.log(ratio)], [old], adv)
    assert loss == pytest.approx(-clipped_ratio * adv, rel=1e-5)
    if has_grad:
        assert grad[0] == pytest.approx(-ratio * adv, rel=1e-5)
    else:
        assert grad[0] == 0.0


def test_surrogate_clip_eps_high():
    """clip_eps_high widens only the upper bound (DAPO clip-higher)."""
    old = -1.0
    up = old + math.log(1.25)
    down = old + math.log(0.7)
    assert _loss([up], [old], 1.0, eps=0.2)[0] == pytest.approx(-1.2)
    assert _loss([up], [old], 1.0, eps=0.2, high=0.28)[0] == pytest.approx(-1.25, rel=1e-5)
    assert _loss([up + math.log(1.1)], [old], 1.0, eps=0.2, high=0.28)[0] == pytest.approx(-1.28)
    assert _loss([down], [old], -1.0, eps=0.2, high=0.28)[0] == pytest.approx(0.8)


# ----------------------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_token_logprobs_with_temperature(temperature):
    """token_logprobs gathers log_softmax(logits / T) at the targets, in float32 even for bf16 logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    got = token_logprobs(logits, targets, temperature)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=0)
    assert got.dtype == torch.float32
    got_bf16 = token_logprobs(logits.bfloat16(), targets, temperature)
    assert got_bf16.dtype == torch.float32
    if temperature != 1.0:
        assert not torch.allclose(got, token_logprobs(logits, targets, 1.0))


# ----------------------------------------------------------------------------- pack


def _sample(prompt_ids, completion_ids, reward, group_id, gen_logprobs=None):
    if gen_logprobs is None:
        gen_logprobs = [-0.1 * (k + 1) for k in range(len(completion_ids))]
    return Sample(
        prompt="p",
        completion="c",
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion_ids),
        gen_logprobs=list(gen_logprobs),
        reward=reward,
        group_id=group_id,
        policy_version=0,
    )


def test_pack_targets_mask_and_old_logprobs():
    """Target t is token t+1; the mask covers exactly the completion targets; old logprobs sit under it."""
    PAD = 999
    samples = [
        _sample([1, 2, 3], [10, 11], 1.0, 0),
        _sample([4], [20, 21, 22, 23], 0.0, 0),
        _sample([5, 6, 7, 8, 9], [30], 1.0, 1),
        _sample([5, 6], [40, 41, 42], 0.0, 1),
    ]
    groups = [Group(samples[:2]), Group(samples[2:])]
    b = pack(groups, pad_id=PAD)
    T = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
    assert b.input_ids_BT.shape == b.targets_BT.shape == b.loss_mask_BT.shape == (4, T)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        n, p, c = len(seq) - 1, len(s.prompt_ids), len(s.completion_ids)
        assert b.input_ids_BT[i, :n].tolist() == seq[:-1]
        assert b.targets_BT[i, :n].tolist() == seq[1:]
        assert (b.input_ids_BT[i, n:] == PAD).all() and (b.targets_BT[i, n:] == PAD).all()
        mask = b.loss_mask_BT[i]
        assert mask.sum().item() == c
        assert b.targets_BT[i][mask.bool()].tolist() == s.completion_ids
        expected_mask = [1.0 if p - 1 <= t < p - 1 + c else 0.0 for t in range(T)]
        assert mask.tolist() == expected_mask
        assert b.old_logprobs_BT[i][mask.bool()].tolist() == pytest.approx(s.gen_logprobs)
        assert (b.old_logprobs_BT[i][~mask.bool()] == 0).all()
    # Per-group advantages, in sample order: group 0 is [1, 0], group 1 is [1, 0].
    assert b.advantages_B.tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_pack_advantage_scaling_flag():
    """pack(scale_by_std=False) gives centered, unscaled advantages."""
    groups = [Group([_sample([1], [2], 3.0, 0), _sample([1], [2], 1.0, 0)])]
    assert pack(groups, 0, scale_by_std=False).advantages_B.tolist() == pytest.approx([1.0, -1.0])
    assert pack(groups, 0, scale_by_std=True).advantages_B.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


# ----------------------------------------------------------------------------- GRPOTrainer


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with peaked distributions (std 0.1) so logprob changes are visible."""
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("grpo") / "ckpt", seed=5, std=0.1)


def _trainer(ckpt, **train_kwargs) -> GRPOTrainer:
    return GRPOTrainer(
        TrainerSetup(ModelConfig(checkpoint=str(ckpt)), TrainConfig(**train_kwargs), temperature=0.8, seed=0)
    )


def _own_logprobs(model, prompt_ids, completion_ids, temperature):
    """Our model's logprobs of the completion tokens from a forward on the unpadded sequence."""
    seq = prompt_ids + completion_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]]))[0].double()
    logp = torch.log_softmax(logits / temperature, -1)
    p = len(prompt_ids)
    return [logp[p - 1 + k, tok].item() for k, tok in enumerate(completion_ids)]


def _groups(model, rewards_per_group, temperature, offset_scale=0.0, seed=0):
    """Random prompt/completion token groups; gen_logprobs = own logprobs + optional offsets."""
    g = torch.Generator().manual_seed(seed)
    groups, gid = [], 0
    for rewards in rewards_per_group:
        samples = []
        for r in rewards:
            p = int(torch.randint(2, 7, (1,), generator=g))
            c = int(torch.randint(1, 6, (1,), generator=g))
            prompt = torch.randint(0, 256, (p,), generator=g).tolist()
            completion = torch.randint(0, 256, (c,), generator=g).tolist()
            own = _own_logprobs(model, prompt, completion, temperature)
            offsets = ((torch.rand(c, generator=g) * 2 - 1) * offset_scale).tolist()
            gen = [o + d for o, d in zip(own, offsets)]
            samples.append(_sample(prompt, completion, r, gid, gen))
        groups.append(Group(samples))
        gid += 1
    return groups


def _hand_loss(model, groups, temperature, eps):
    """Token-mean PPO-clip loss computed per unpadded sequence, in float64, from first principles."""
    total, n_tok = 0.0, 0
    for group in groups:
        rs = group.rewards
        mean, std = statistics.fmean(rs), statistics.pstdev(rs)
        for s in group.samples:
            a = (s.reward - mean) / (std + 1e-6)
            for lp, old in zip(_own_logprobs(model, s.prompt_ids, s.completion_ids, temperature), s.gen_logprobs):
                ratio = math.exp(lp - old)
                total += -min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
                n_tok += 1
    return total / n_tok


@pytest.mark.parametrize("micro_batch_size", [64, 1])
@pytest.mark.parametrize("offset_scale", [0.0, 0.4])
def test_step_loss_matches_hand_computation(ckpt, micro_batch_size, offset_scale):
    """One step on two padded groups reports the same loss as the per-sequence unpadded formula (1e-6)."""
    tr = _trainer(ckpt, memory=MemoryConfig(micro_batch_size=micro_batch_size))
    groups = _groups(tr.model, [[1.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.25]], tr.temperature, offset_scale)
    expected = _hand_loss(tr.model, groups, tr.temperature, tr.cfg.loss.clip_eps)
    metrics = tr.step(groups)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-6)
    assert metrics["train/tokens"] == sum(len(s.completion_ids) for g in groups for s in g.samples)
    if offset_scale == 0.0:
        assert metrics["train/mismatch_max_abs"] < 1e-5  # gen logprobs are our own: ratio == 1
        assert metrics["train/clip_fraction"] == 0.0
    else:
        assert metrics["train/mismatch_max_abs"] > 0.01
        assert metrics["train/clip_fraction"] > 0  # some ratios leave [0.8, 1.2]: clipping is exercised


def test_step_changes_weights_and_increments_version(ckpt):
    """With nonzero advantages a step moves the weights, reports grad_norm > 0 and bumps the version."""
    tr = _trainer(ckpt)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    groups = _groups(tr.model, [[1.0, 0.0], [0.0, 1.0, 1.0]], tr.temperature)
    assert tr.get_version() == 0
    m = tr.step(groups)
    assert tr.get_version() == 1
    assert m["grad_norm"] > 0 and m["train/advantage_nonzero_frac"] == 1.0
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(before) // 2


def test_step_positive_advantage_raises_logprob(ckpt):
    """After a step, the positive-advantage completion is more likely and the negative one less."""
    tr = _trainer(ckpt, optimizer=OptimizerConfig(lr=1e-3))
    groups = _groups(tr.model, [[1.0, 0.0]], tr.temperature, seed=3)
    good, bad = groups[0].samples
    lp = lambda s: sum(_own_logprobs(tr.model, s.prompt_ids, s.completion_ids, tr.temperature))  # noqa: E731
    good0, bad0 = lp(good), lp(bad)
    tr.step(groups)
    assert lp(good) > good0 and lp(bad) < bad0


def test_step_all_equal_rewards_leaves_weights_unchanged(ckpt):
    """Groups with all-equal rewards (incl. 0.1, 0.3) give zero advantages: grad_norm 0, weights bitwise unchanged."""
    tr = _trainer(ckpt)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    groups = _groups(tr.model, [[0.3] * 6, [0.1] * 7, [1.0] * 2], tr.temperature)
    m = tr.step(groups)
    assert m["grad_norm"] == 0.0
    assert m["loss"] == 0.0
    assert m["train/advantage_nonzero_frac"] == 0.0
    assert tr.get_version() == 1
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_save_round_trips_trainer_weights(ckpt, tmp_path):
    """save() writes an HF checkpoint that load_model reads back bitwise equal to the trained weights."""
    tr = _trainer(ckpt)
    tr.step(_groups(tr.model, [[1.0, 0.0, 0.0]], tr.temperature))
    out = tr.save(str(tmp_path / "saved"))
    loaded, cfg = load_model(out)
    original, _ = load_model(ckpt)
    assert cfg == tr.model_config
    state = tr.model.state_dict()
    assert set(loaded.state_dict()) == set(state)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert not torch.equal(original.state_dict()["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert (tmp_path / "saved" / "tokenizer.json").is_file()


def test_state_dict_for_push_is_a_copy(ckpt):
    """Pushed weights are HF-named clones: later steps do not change an already-pushed dict."""
    tr = _trainer(ckpt)
    pushed = tr.state_dict_for_push()
    assert "lm_head.weight" not in pushed  # tied head omitted, as in HF files
    snap = pushed["model.embed_tokens.weight"].clone()
    tr.step(_groups(tr.model, [[1.0, 0.0]], tr.temperature))
    assert torch.equal(pushed["model.embed_tokens.weight"], snap)
    assert not torch.equal(tr.model.model.embed_tokens.weight.detach(), snap)


# ----------------------------------------------------------------------------- minibatches, epochs


def test_minibatch_row_ranges_split_whole_groups():
    """Minibatches are contiguous runs of whole groups whose group counts differ by at most one."""
    from titanrl.trainer.batch import minibatch_row_ranges

    assert minibatch_row_ranges([2, 3, 2, 4, 1], 1) == [(0, 12)]
    assert minibatch_row_ranges([2, 3, 2, 4, 1], 2) == [(0, 7), (7, 12)]  # groups 0-2 | 3-4
    assert minibatch_row_ranges([2, 3, 2, 4, 1], 3) == [(0, 5), (5, 11), (11, 12)]
    assert minibatch_row_ranges([4, 4], 5) == [(0, 4), (4, 8)]  # never an empty minibatch


def _params(tr):
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _assert_same_params(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_minibatches_and_epochs_equal_separate_steps(ckpt):
    """ppo_epochs=2, minibatches=2 on groups [g0, g1, g2] is exactly four plain steps on [g0, g1], [g2],
    [g0, g1], [g2] (old logprobs stay the generator's): bitwise-equal weights, loss and grad_norm are
    the means of theirs, the version moves by one and the metrics count 4 optimizer steps."""
    a = _trainer(ckpt, ppo_epochs=2, minibatches=2, optimizer=OptimizerConfig(lr=1e-3))
    b = _trainer(ckpt, optimizer=OptimizerConfig(lr=1e-3))
    groups = _groups(a.model, [[1.0, 0.0], [0.0, 0.5, 1.0], [0.2, 0.9]], a.temperature, offset_scale=0.3)
    m = a.step(groups)
    parts = [b.step(groups[:2]), b.step(groups[2:]), b.step(groups[:2]), b.step(groups[2:])]
    _assert_same_params(_params(a), _params(b))
    assert a.get_version() == 1 and b.get_version() == 4
    assert m["train/optimizer_steps"] == 4.0 and m["train/skipped_optimizer_steps"] == 0.0
    assert m["loss"] == pytest.approx(sum(p["loss"] for p in parts) / 4, rel=1e-12)
    assert m["grad_norm"] == pytest.approx(sum(p["grad_norm"] for p in parts) / 4, rel=1e-12)
    assert m["train/mismatch_max_abs"] == parts[0]["train/mismatch_max_abs"]  # first forward only
    assert m["train/tokens"] == sum(len(s.completion_ids) for g in groups for s in g.samples)
    assert a.scheduler.last_epoch == 4
    assert m["policy_version"] == 1.0 and m["train/skipped"] == 0.0


def test_mismatch_measured_before_any_update(ckpt):
    """With 3 epochs at a large lr the later passes are off the generator's weights (ratios get
    clipped), yet the mismatch metric, taken on the first forward, stays at the on-policy ~0."""
    tr = _trainer(ckpt, ppo_epochs=3, optimizer=OptimizerConfig(lr=3e-2))
    groups = _groups(tr.model, [[1.0, 0.0, 0.0], [0.0, 1.0]], tr.temperature)
    m = tr.step(groups)
    assert m["train/mismatch_max_abs"] < 1e-5
    assert m["train/clip_fraction"] > 0  # only later passes can clip: the first is on-policy


def test_micro_batch_size_does_not_change_gradients(ckpt):
    """The accumulated gradient of every parameter is the same (max abs diff <= 1e-6) whether the batch
    runs as 1-row or 64-row micro-batches, and it is not trivially zero."""
    small, big = (
        _trainer(ckpt, memory=MemoryConfig(micro_batch_size=1)),
        _trainer(ckpt, memory=MemoryConfig(micro_batch_size=64)),
    )
    groups = _groups(small.model, [[1.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.25]], small.temperature, offset_scale=0.4)
    batch = pack(groups, small.pad_id)
    s1, s64 = small.accumulate_gradients(batch), big.accumulate_gradients(batch)
    assert s1.tokens == s64.tokens and s1.loss_sum == pytest.approx(s64.loss_sum, abs=1e-5)
    grads1 = {n: p.grad for n, p in small.model.named_parameters()}
    grads64 = {n: p.grad for n, p in big.model.named_parameters()}
    assert grads1.keys() == grads64.keys()
    for n in grads1:
        assert (grads1[n] - grads64[n]).abs().max().item() <= 1e-6, n
    assert grads64["model.embed_tokens.weight"].abs().max().item() > 1e-3


def test_lr_reaches_min_at_the_last_optimizer_step(ckpt):
    """A cosine run of steps=2 with 2 epochs x 2 minibatches: the last optimizer step (the 8th) uses
    min_lr_ratio * lr, and the schedule spans all 8."""
    tr = _trainer(
        ckpt,
        steps=2,
        ppo_epochs=2,
        minibatches=2,
        optimizer=OptimizerConfig(lr=1e-3),
        lr_schedule=LrScheduleConfig(decay="cosine", min_lr_ratio=0.1),
    )
    groups = _groups(tr.model, [[1.0, 0.0], [0.0, 1.0]], tr.temperature)
    first = tr.step(groups)
    last = tr.step(groups)
    assert first["lr"] < 1e-3 and first["lr"] > 1e-4
    assert last["lr"] == pytest.approx(0.1 * 1e-3, rel=1e-12)
    assert tr.scheduler.last_epoch == 8


# ----------------------------------------------------------------------------- non-finite steps


def _optimizer_state(tr):
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in tr.optimizer.state_dict()["state"].items()}


def _assert_same_optimizer_state(a, b):
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])), (i, k)


def _with_nan_logprob(group):
    s = group.samples[0]
    bad = _sample(s.prompt_ids, s.completion_ids, s.reward, s.group_id, [float("nan")] + s.gen_logprobs[1:])
    return Group([bad] + group.samples[1:])


@pytest.mark.parametrize("poison", ["nan_logprob", "inf_reward"])
def test_non_finite_step_is_skipped(ckpt, poison):
    """A call whose loss is not finite (NaN generator logprob, or an inf reward making NaN advantages)
    takes no optimizer step: weights, optimizer state and schedule bitwise unchanged, version kept,
    skip counters count it, and the next good call updates and resets the consecutive count."""
    tr = _trainer(ckpt, optimizer=OptimizerConfig(lr=1e-3))
    good = _groups(tr.model, [[1.0, 0.0], [0.0, 1.0, 0.5]], tr.temperature)
    tr.step(good)  # the optimizer now has state to protect
    params, opt_state, sched = _params(tr), _optimizer_state(tr), tr.scheduler.state_dict()
    if poison == "nan_logprob":
        bad = [good[0], _with_nan_logprob(good[1])]
    else:
        g = good[1]
        bad = [good[0], Group([_sample(s.prompt_ids, s.completion_ids, r, s.group_id, s.gen_logprobs)
                               for s, r in zip(g.samples, [float("inf"), 0.0, 1.0])])]
    for n in (1, 2):
        m = tr.step(bad)
        assert m["train/skipped"] == 1.0 and m["train/skipped_steps"] == n and m["train/consecutive_skipped"] == n
        assert m["train/optimizer_steps"] == 0.0 and m["train/skipped_optimizer_steps"] == 1.0
        assert m["policy_version"] == 1.0 and tr.get_version() == 1
        assert not math.isfinite(m["loss"])
    _assert_same_params(_params(tr), params)
    _assert_same_optimizer_state(_optimizer_state(tr), opt_state)
    assert tr.scheduler.state_dict() == sched
    assert all(p.grad is None for p in tr.model.parameters())
    m = tr.step(good)
    assert m["train/skipped"] == 0.0 and m["train/consecutive_skipped"] == 0.0 and m["train/skipped_steps"] == 2.0
    assert m["policy_version"] == 2.0 and math.isfinite(m["loss"])


def test_non_finite_minibatch_skips_only_its_step(ckpt):
    """With 2 minibatches and a NaN only in the second, the first optimizer step is taken and the
    second skipped: weights equal a trainer that stepped on the first minibatch alone, version + 1."""
    a, b = (
        _trainer(ckpt, minibatches=2, optimizer=OptimizerConfig(lr=1e-3)),
        _trainer(ckpt, optimizer=OptimizerConfig(lr=1e-3)),
    )
    good = _groups(a.model, [[1.0, 0.0], [0.0, 1.0, 0.5]], a.temperature)
    m = a.step([good[0], _with_nan_logprob(good[1])])
    ref = b.step([good[0]])
    assert m["train/optimizer_steps"] == 1.0 and m["train/skipped_optimizer_steps"] == 1.0
    assert m["train/skipped"] == 0.0 and m["policy_version"] == 1.0
    assert m["loss"] == ref["loss"] and m["grad_norm"] == ref["grad_norm"]  # means over steps taken
    _assert_same_params(_params(a), _params(b))
    _assert_same_optimizer_state(_optimizer_state(a), _optimizer_state(b))


# ----------------------------------------------------------------------------- decoupled loss


def test_decoupled_loss_on_policy_equals_ppo_clip_with_identical_gradients():
    """When the behaviour logprobs are the proximal ones (on-policy), the decoupled loss and its gradient
    are exactly PPO-clip's."""
    from titanrl.trainer.grpo import decoupled_surrogate_loss

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), (torch.rand(3, 5, generator=g) > 0.2).float()
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    plain, _ = clipped_surrogate_loss(a, base, adv, mask, 0.2)
    decoupled, _ = decoupled_surrogate_loss(b, base, base, adv, mask, 0.2)
    plain.backward()
    decoupled.backward()
    assert torch.equal(plain, decoupled) and torch.equal(a.grad, b.grad)


def test_decoupled_loss_keeps_stale_tokens_with_a_truncated_weight():
    """Tokens sampled by an older policy (pi_prox / pi_behav = 1.5 and 3) keep a gradient, -A * weight per
    token with the weight truncated at 2; plain PPO-clip around the behaviour policy clips them to zero."""
    from titanrl.trainer.grpo import decoupled_surrogate_loss

    prox = torch.tensor([[-1.0, -2.0]])
    behaviour = prox - torch.log(torch.tensor([[1.5, 3.0]]))
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    lp = prox.clone().requires_grad_()
    loss, _ = decoupled_surrogate_loss(lp, prox, behaviour, adv, mask, 0.2, weight_cap=2.0)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.5, -2.0]]), atol=1e-6)
    lp_plain = prox.clone().requires_grad_()
    plain, _ = clipped_surrogate_loss(lp_plain, behaviour, adv, mask, 0.2)
    plain.backward()
    assert torch.equal(lp_plain.grad, torch.zeros(1, 2))


def test_trainer_decoupled_loss_on_policy_matches_plain_step(ckpt):
    """A GRPOTrainer step with decoupled_loss on groups whose generator logprobs are the trainer's own gives
    the same loss and weights as the plain step (to float rounding); with two minibatches the proximal
    logprobs are measured once up front and the step still trains."""
    plain, decoupled = _trainer(ckpt), _trainer(ckpt, off_policy=OffPolicyConfig(decoupled_loss=True))
    groups = _groups(plain.model, [[1.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.25]], plain.temperature)
    m_plain, m_dec = plain.step(groups), decoupled.step(groups)
    assert m_dec["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    for (name, p), q in zip(plain.model.named_parameters(), decoupled.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    two = _trainer(ckpt, off_policy=OffPolicyConfig(decoupled_loss=True), minibatches=2)
    metrics = two.step(groups)
    assert metrics["train/optimizer_steps"] == 2.0 and math.isfinite(metrics["loss"])
