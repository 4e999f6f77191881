"""train.loss.objective variants, aggregation modes, entropy bonus and off-policy corrections: values worked
by hand on small tensors, and each variant's gradient through the trainer against a direct
per-row formula differentiated by torch.autograd."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from titanrl.config import ModelConfig, TrainConfig
from titanrl.config.schema import (
    LossConfig,
    MemoryConfig,
    OffPolicyConfig,
    OptimizerConfig,
)
from titanrl.trainer.batch import pack
from titanrl.trainer.grpo import group_advantages
from titanrl.trainer.losses.aggregation import batch_sequences, row_weights
from titanrl.trainer.losses.measures import combine_passes, loss_metrics
from titanrl.trainer.losses.off_policy import correction_weights
from titanrl.trainer.losses.policy import policy_loss
from titanrl.trainer.losses.settings import loss_settings
from titanrl.trainer.setup import TrainerSetup
from titanrl.trainer.trainer import GRPOTrainer
from titanrl.types import Group, Sample

LOG = math.log


def _close(t: torch.Tensor, expected: list, tol: float = 1e-12) -> bool:
    return torch.allclose(t.detach().double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=tol)


def _row_sum(x_BT: torch.Tensor) -> torch.Tensor:
    return x_BT.sum(1)


def _ratios(rows: list[list[float]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-ratios [B, width], mask) of right-padded rows of ratios, in float64."""
    log_r = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros_like(log_r)
    for i, row in enumerate(rows):
        log_r[i, :len(row)] = torch.tensor([LOG(r) for r in row], dtype=torch.float64)
        mask[i, :len(row)] = 1.0
    return log_r, mask


def _policy(loss: str, log_r, mask, adv, weights=None, **loss_fields):
    """policy_loss of `loss` with logprobs = anchor + log_r (anchor 0), returning (sum, stats, logprobs)."""
    s = loss_settings(TrainConfig(loss=LossConfig(objective=loss, **loss_fields)))
    logprobs = log_r.clone().requires_grad_()
    out, stats = policy_loss(s, logprobs, torch.zeros_like(log_r), torch.tensor(adv, dtype=torch.float64), mask,
                             weights, _row_sum, mask.sum(1))
    return out, stats, logprobs


# ----------------------------------------------------------------------------- variants by hand


def test_grpo_clip_by_hand():
    """A=+1 row with ratios 1.5, 1.1 and A=-1 row with 0.5, 1.0 at eps 0.2: per token
    -min(rA, clip(r)A) = -1.2 (clipped high), -1.1, +0.8 (clipped low), +1.0; sum -0.5; the
    clipped tokens get no gradient, the others -A * r."""
    log_r, mask = _ratios([[1.5, 1.1], [0.5, 1.0]], 2)
    loss, stats, lp = _policy("grpo", log_r, mask, [1.0, -1.0])
    assert loss.item() == pytest.approx(-0.5, abs=1e-12)
    counts = [stats[k].item() for k in ("clip_low_tokens", "clip_high_tokens", "clipped_tokens")]
    assert counts == [1, 1, 2]
    loss.backward()
    assert _close(lp.grad, [[0.0, -1.1], [0.0, 1.0]])


def test_dapo_clips_higher_at_0_28_by_default():
    """Ratio 1.25 with A=+1: grpo clips it to 1.2 (loss -1.2, no gradient), dapo's 0.28 upper
    range keeps it (loss -1.25, gradient -1.25); the lower range stays 0.2 (ratio 0.7, A=-1: 0.8)."""
    log_r, mask = _ratios([[1.25], [0.7]], 1)
    grpo, _, _ = _policy("grpo", log_r, mask, [1.0, -1.0])
    dapo, stats, lp = _policy("dapo", log_r, mask, [1.0, -1.0])
    assert grpo.item() == pytest.approx(-1.2 + 0.8, abs=1e-12)
    assert dapo.item() == pytest.approx(-1.25 + 0.8, abs=1e-12)
    dapo.backward()
    assert _close(lp.grad, [[-1.25], [0.0]])
    assert (stats["clip_low_tokens"].item(), stats["clip_high_tokens"].item()) == (1, 0)
    assert loss_settings(TrainConfig(loss=LossConfig(objective="dapo", clip_eps_high=0.3))).clip_high == 0.3


def test_dr_grpo_settings_and_advantages_by_hand():
    """dr_grpo: advantages only centred (rewards 1, 0, 0, 1 -> +-0.5, not +-1), the constant
    normaliser aggregation, and grpo's clip."""
    s = loss_settings(TrainConfig(loss=LossConfig(objective="dr_grpo", length_norm=16)))
    assert (s.scale_by_std, s.aggregation, s.clip_low, s.clip_high) == (False, "seq-mean-token-sum-norm", 0.2, 0.2)
    assert loss_settings(TrainConfig()).scale_by_std is True
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert group_advantages(rewards, scale_by_std=s.scale_by_std).tolist() == [0.5, -0.5, -0.5, 0.5]


def test_gspo_sequence_ratio_by_hand():
    """Row 0 (A=+1): log-ratios 0.2, 0.0 -> s = e^0.1 = 1.10517 > 1 + 4e-4, clipped: its two tokens
    each carry -(1 + 4e-4), no gradient. Row 1 (A=-1): log-ratio 1e-4 (one token) -> s = e^1e-4,
    inside (1 - 3e-4, 1 + 4e-4): loss +s, gradient d s / d logp = s / n = s."""
    log_r, mask = _ratios([[math.exp(0.2), 1.0], [math.exp(1e-4)]], 2)
    loss, stats, lp = _policy("gspo", log_r, mask, [1.0, -1.0])
    s1 = math.exp(1e-4)
    assert loss.item() == pytest.approx(-2 * 1.0004 + s1, abs=1e-12)
    loss.backward()
    assert _close(lp.grad, [[0.0, 0.0], [s1, 0.0]])
    assert (stats["clipped_sequences"].item(), stats["sequences"].item(), stats["clip_high_tokens"].item()) == (1, 2, 2)
    s = loss_settings(TrainConfig(loss=LossConfig(objective="gspo")))
    assert (s.clip_low, s.clip_high, s.aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")


def test_gspo_gradient_spreads_over_the_sequence():
    """Unclipped GSPO row of n tokens, each carrying -A * s with s = exp(mean log r): the sum
    -n A s has gradient -n A s / n = -A s at every token, whatever its own ratio (n = 3,
    log-ratios 0.01, -0.02, 0.04, A = 2, wide clip range)."""
    log_r, mask = _ratios([[math.exp(0.01), math.exp(-0.02), math.exp(0.04)]], 3)
    loss, _, lp = _policy("gspo", log_r, mask, [2.0], gspo_clip_eps=(0.5, 0.5))
    s = math.exp(0.01)
    assert loss.item() == pytest.approx(-3 * 2 * s, abs=1e-12)  # three tokens carry the sequence's loss
    loss.backward()
    assert _close(lp.grad, [[-2 * s] * 3])


def test_cispo_by_hand():
    """CISPO with A=+1, logp -1 and -2, ratios 2.0 and 0.5: weights min(r, 1.28) = 1.28 and 0.5 (no
    lower bound), loss -(1.28 * -1) - (0.5 * -2) = 2.28, gradient -w * A = -1.28, -0.5 (the
    truncated token keeps its gradient)."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[LOG(2.0), LOG(0.5)]], dtype=torch.float64)
    mask = torch.ones_like(old)
    s = loss_settings(TrainConfig(loss=LossConfig(objective="cispo")))
    loss, stats = policy_loss(s, logp, old, torch.tensor([1.0], dtype=torch.float64), mask, None, _row_sum,
                              mask.sum(1))
    assert loss.item() == pytest.approx(2.28, abs=1e-12)
    loss.backward()
    assert _close(logp.grad, [[-1.28, -0.5]])
    assert (stats["clip_high_tokens"].item(), stats["clip_low_tokens"].item()) == (1, 0)


# ----------------------------------------------------------------------------- aggregation by hand


def test_aggregation_weights_by_hand():
    """Rows of 2, 1 and 0 trained tokens (N = 3, S = 2): seq-mean-token-mean weights N / (S n_i) =
    0.75, 1.5, 0; sum-norm with L = 4: N / (S L) = 0.375, 0.375, 0; token-mean: none. With token
    losses a, b | c the weighted sums over N give ((a+b)/2 + c)/2 and ((a+b)/4 + c/4)/2."""
    n = torch.tensor([2.0, 1.0, 0.0])
    N, S = n.sum(), batch_sequences(n)
    assert S.item() == 2
    assert row_weights("token-mean", n, N, S, None) is None
    assert row_weights("seq-mean-token-mean", n, N, S, None).tolist() == [0.75, 1.5, 0.0]
    assert row_weights("seq-mean-token-sum-norm", n, N, S, 4).tolist() == [0.375, 0.375, 0.0]
    a, b, c = 1.0, 3.0, 5.0
    w = row_weights("seq-mean-token-mean", n, N, S, None)
    assert ((a + b) * w[0] + c * w[1]).item() / N.item() == pytest.approx(((a + b) / 2 + c) / 2)
    w = row_weights("seq-mean-token-sum-norm", n, N, S, 4)
    assert ((a + b) * w[0] + c * w[1]).item() / N.item() == pytest.approx(((a + b) / 4 + c / 4) / 2)


# ----------------------------------------------------------------------------- off-policy by hand

_OFF_ROWS = [[3.0, 0.8], [1.5], [4.0, 1.5]]
"""pi_prox / pi_generator per token: sequence products 2.4, 1.5, 6; geometric means 1.55, 1.5, 2.45."""


@pytest.mark.parametrize("mode, weights, clipped, masked", [
    ("tis_token", [[2.0, 0.8], [1.5, 0.0], [2.0, 1.5]], 2, 0),
    ("tis_sequence", [[2.0, 2.0], [1.5, 0.0], [2.0, 2.0]], 4, 0),
    ("mis_token", [[0.0, 0.8], [1.5, 0.0], [0.0, 1.5]], 0, 2),
    ("mis_sequence", [[0.0, 0.0], [1.5, 0.0], [0.0, 0.0]], 0, 4),
    ("mis_geometric", [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], 0, 2),
])
def test_off_policy_weights_by_hand(mode, weights, clipped, masked):
    """cap 2, low 0.5 on `_OFF_ROWS`: truncation at 2 per token / per sequence product; masking
    outside [0.5, 2] of the token ratio, the sequence product, or the geometric mean (weight 1)."""
    log_r, mask = _ratios(_OFF_ROWS, 2)
    w, stats = correction_weights(mode, log_r, torch.zeros_like(log_r), mask, 2.0, 0.5, _row_sum, mask.sum(1))
    assert _close(w * mask, weights)
    assert stats["offpolicy_clipped_tokens"].item() == clipped
    assert stats["offpolicy_masked_tokens"].item() == masked
    # Token ratios 3, 0.8, 1.5, 4, 1.5: mean 10.8 / 5, max 4, min 0.8.
    assert stats["offpolicy_ratio_sum"].item() == pytest.approx(10.8)
    assert stats["offpolicy_ratio_max"].item() == pytest.approx(4.0)
    assert -stats["offpolicy_ratio_neg_min"].item() == pytest.approx(0.8)


def test_off_policy_settings():
    """decoupled_loss is token TIS at behaviour_weight_cap; off_policy_low defaults to 1 / cap."""
    s = loss_settings(TrainConfig(off_policy=OffPolicyConfig(decoupled_loss=True, behaviour_weight_cap=3.0)))
    assert (s.correction, s.cap, s.at_proximal) == ("tis_token", 3.0, True)
    s = loss_settings(TrainConfig(off_policy=OffPolicyConfig(correction="mis_token", cap=4.0)))
    assert (s.correction, s.cap, s.low) == ("mis_token", 4.0, 0.25)
    assert not loss_settings(TrainConfig()).at_proximal


def test_loss_metrics_from_measures():
    """Fractions over the trained tokens of two passes (sums add, maxima max)."""
    s = loss_settings(
        TrainConfig(loss=LossConfig(objective="gspo"), off_policy=OffPolicyConfig(correction="tis_token"))
    )
    one = {"clip_low_tokens": 1.0, "clip_high_tokens": 2.0, "clipped_sequences": 1.0, "sequences": 2.0,
           "offpolicy_ratio_sum": 4.0, "offpolicy_weight_sum": 3.0, "offpolicy_clipped_tokens": 1.0,
           "offpolicy_masked_tokens": 0.0, "offpolicy_ratio_max": 3.0, "offpolicy_ratio_neg_min": -0.5}
    two = dict(one, offpolicy_ratio_max=5.0, offpolicy_ratio_neg_min=-0.25)
    m = loss_metrics(s, combine_passes([one, two]), tokens=8.0)
    assert m["loss/clip_low_fraction"] == 2 / 8 and m["loss/clip_high_fraction"] == 4 / 8
    assert m["loss/clip_seq_fraction"] == 2 / 4
    assert (m["offpolicy/ratio_mean"], m["offpolicy/ratio_max"], m["offpolicy/ratio_min"]) == (1.0, 5.0, 0.25)
    assert (m["offpolicy/weight_mean"], m["offpolicy/clipped_fraction"]) == (6 / 8, 2 / 8)


# ----------------------------------------------------------------------------- gradients through the trainer

TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from titanrl.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("losses") / "ckpt", seed=3, std=0.1)


def _batch_groups(model, seed: int = 0, noise: float = 0.4) -> list[Group]:
    """Two groups of 3 with completions of 1-6 tokens, some env-inserted (masked) tokens, and
    generator logprobs = the model's own + uniform noise in [-noise, noise] (so ratios, and
    sequence products of them, fall on both sides of each clip and mask bound)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid, rewards in enumerate([[1.0, 0.0, 0.5], [0.0, 1.0, 0.25]]):
        samples = []
        for r in rewards:
            prompt = torch.randint(0, 256, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            c = int(torch.randint(1, 7, (1,), generator=g))
            completion = torch.randint(0, 256, (c,), generator=g).tolist()
            seq = torch.tensor([prompt + completion])
            with torch.no_grad():
                own = torch.log_softmax(model(seq[:, :-1])[0, len(prompt) - 1:] / TEMPERATURE, -1)
            own = own.gather(-1, torch.tensor(completion)[:, None])[:, 0]
            gen = (own + noise * (2 * torch.rand(c, generator=g) - 1)).tolist()
            mask = [1] * c if c < 3 else [1, 0] + [1] * (c - 2)
            samples.append(Sample(prompt="", completion="", prompt_ids=prompt, completion_ids=completion,
                                  gen_logprobs=gen, reward=r, group_id=gid, policy_version=0, loss_mask=mask))
        groups.append(Group(samples))
    return groups


def _reference_loss(model, batch, cfg: TrainConfig) -> torch.Tensor:
    """The loss from the formulas, row by row over the whole padded batch in one forward."""
    s = loss_settings(cfg)
    logits = model(batch.input_ids_BT).double() / TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    lp_BT = logp_all.gather(-1, batch.targets_BT[..., None])[..., 0]
    ent_BT = -(logp_all.exp() * logp_all).sum(-1)
    rows = []  # (token losses, n) per row with trained tokens
    for i in range(batch.input_ids_BT.shape[0]):
        keep = batch.loss_mask_BT[i] > 0
        if not keep.any():
            continue
        lp, old, ent = lp_BT[i][keep], batch.old_logprobs_BT[i][keep].double(), ent_BT[i][keep]
        A = batch.advantages_B[i].item()
        anchor = lp.detach() if s.at_proximal else old
        r = torch.exp(lp - anchor)
        if s.loss == "gspo":
            seq = torch.exp((lp - anchor).mean())
            pg = (-torch.minimum(seq * A, seq.clamp(1 - s.clip_low, 1 + s.clip_high) * A)).expand(len(lp))
        elif s.loss == "cispo":
            pg = -(r.detach().clamp(max=1 + s.clip_high) * A * lp)
        else:
            pg = -torch.minimum(r * A, r.clamp(1 - s.clip_low, 1 + s.clip_high) * A)
        w = torch.exp(anchor - old).detach()  # pi_prox / pi_generator
        prod, geo = w.prod(), w.prod() ** (1 / len(w))
        c = {"none": torch.ones_like(w), "tis_token": w.clamp(max=s.cap),
             "tis_sequence": prod.clamp(max=s.cap).expand(len(w)),
             "mis_token": torch.where((w >= s.low) & (w <= s.cap), w, 0 * w),
             "mis_sequence": (prod if s.low <= prod <= s.cap else 0 * prod).expand(len(w)),
             "mis_geometric": torch.full_like(w, float(s.low <= geo <= s.cap))}[s.correction]
        rows.append((c * pg - s.entropy_coef * ent, len(lp)))
    if s.aggregation == "token-mean":
        return sum(x.sum() for x, _ in rows) / sum(n for _, n in rows)
    if s.aggregation == "seq-mean-token-mean":
        return sum(x.sum() / n for x, n in rows) / len(rows)
    return sum(x.sum() / s.length_norm for x, _ in rows) / len(rows)


CASES = {
    "grpo": dict(),
    "grpo_seq_mean_entropy": dict(loss=LossConfig(aggregation="seq-mean-token-mean", entropy_coef=0.05)),
    "grpo_sum_norm": dict(loss=LossConfig(aggregation="seq-mean-token-sum-norm", length_norm=8)),
    "dr_grpo": dict(loss=LossConfig(objective="dr_grpo", length_norm=8)),
    "dapo": dict(loss=LossConfig(objective="dapo")),
    "gspo": dict(loss=LossConfig(objective="gspo", gspo_clip_eps=(0.02, 0.03))),
    "gspo_paper_clip": dict(loss=LossConfig(objective="gspo")),
    "cispo": dict(loss=LossConfig(objective="cispo", entropy_coef=0.02, clip_eps_high=0.1)),
    "decoupled_seq_mean": dict(
        off_policy=OffPolicyConfig(decoupled_loss=True, behaviour_weight_cap=1.1),
        loss=LossConfig(aggregation="seq-mean-token-mean"),
    ),
    **{
        f"grpo_{m}": dict(off_policy=OffPolicyConfig(correction=m, cap=1.1))
        for m in ("tis_token", "tis_sequence", "mis_token", "mis_sequence", "mis_geometric")
    },
    "gspo_tis_sequence": dict(
        loss=LossConfig(objective="gspo", gspo_clip_eps=(0.02, 0.03)),
        off_policy=OffPolicyConfig(correction="tis_sequence", cap=1.1),
    ),
}
"""Bounds are set so that every case clips, truncates or masks some of the batch's tokens (the
ratios to the generator lie in ~[0.7, 1.25])."""


@pytest.mark.parametrize("name", sorted(CASES))
def test_trainer_gradient_matches_direct_formula(ckpt, name):
    """GRPOTrainer.accumulate_gradients (micro-batches of 2 rows, padded and trimmed) gives the
    loss and the gradient of every parameter that autograd gives through the per-row formula
    on one forward of the whole batch (float64), for each variant, aggregation and correction."""
    cfg = TrainConfig(memory=MemoryConfig(micro_batch_size=2), **CASES[name])
    tr = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), cfg, temperature=TEMPERATURE, seed=0))
    s = tr.grpo.loss
    batch = pack(_batch_groups(tr.model), pad_id=0, scale_by_std=s.scale_by_std, current_version=0)
    stats = tr.accumulate_gradients(batch)
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters()}
    tr.model.zero_grad(set_to_none=True)
    ref = _reference_loss(tr.model, batch, cfg)
    ref.backward()
    assert stats.loss_sum / stats.tokens == pytest.approx(ref.item(), rel=1e-5, abs=2e-6)  # float32 vs float64
    flat = torch.cat([grads[n].flatten() for n in sorted(grads)]).double()
    flat_ref = torch.cat([p.grad.flatten() for n, p in sorted(tr.model.named_parameters())]).double()
    assert flat_ref.norm() > 0
    assert ((flat - flat_ref).norm() / flat_ref.norm()).item() < 1e-4
    m = stats.loss_measures
    assert stats.clipped_tokens + m.get("offpolicy_clipped_tokens", 0) + m.get("offpolicy_masked_tokens", 0) > 0


def test_default_loss_is_todays_grpo(ckpt):
    """loss='grpo' with defaults is today's PPO-clip step: GRPOTrainer's loss equals
    clipped_surrogate_loss on the trainer's own logprobs, divided by the token count, bit for bit."""
    from titanrl.trainer.grpo import clipped_surrogate_loss

    tr = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), TrainConfig(), temperature=TEMPERATURE, seed=0))
    batch = pack(_batch_groups(tr.model), pad_id=0, current_version=0)
    stats = tr.accumulate_gradients(batch)
    with torch.no_grad():
        lp = tr.token_logprobs(tr.model(batch.input_ids_BT), batch.targets_BT, TEMPERATURE)
        want, _ = clipped_surrogate_loss(lp, batch.old_logprobs_BT, batch.advantages_B, batch.loss_mask_BT, 0.2)
    assert stats.loss_sum == pytest.approx(want.item(), rel=1e-6)
    assert stats.loss_measures.keys() == {"clip_low_tokens", "clip_high_tokens"}


def test_step_metrics_and_batch_start_ratio_with_minibatches(ckpt):
    """A step with off_policy_correction and two minibatches: the ratio pi_trainer / pi_generator
    is at the batch-start weights in both minibatches (the mean of exp(own - generator) measured
    before the step), and the clip fractions low + high add up to train/clip_fraction."""
    cfg = TrainConfig(
        off_policy=OffPolicyConfig(correction="tis_token"),
        minibatches=2,
        optimizer=OptimizerConfig(lr=1e-2),
        memory=MemoryConfig(micro_batch_size=2),
    )
    tr = GRPOTrainer(TrainerSetup(ModelConfig(checkpoint=str(ckpt)), cfg, temperature=TEMPERATURE, seed=0))
    groups = _batch_groups(tr.model, seed=1)
    batch = pack(groups, pad_id=0, current_version=0)
    with torch.no_grad():
        lp = tr.token_logprobs(tr.model(batch.input_ids_BT), batch.targets_BT, TEMPERATURE)
    m = batch.loss_mask_BT > 0
    ratio = torch.exp(lp - batch.old_logprobs_BT)[m]
    metrics = tr.step(groups)
    assert metrics["offpolicy/ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-5)
    assert metrics["offpolicy/ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-5)
    assert metrics["offpolicy/ratio_min"] == pytest.approx(ratio.min().item(), rel=1e-5)
    assert metrics["offpolicy/clipped_fraction"] == pytest.approx((ratio > 2.0).float().mean().item())
    assert metrics["loss/clip_low_fraction"] + metrics["loss/clip_high_fraction"] == pytest.approx(
        metrics["train/clip_fraction"])
    assert metrics["train/optimizer_steps"] == 2.0


# ----------------------------------------------------------------------------- validation


@pytest.fixture
def run_config(tmp_path, ckpt):
    from titanrl.config import DataConfig, RunConfig

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1="}\n')
    return RunConfig(model=ModelConfig(checkpoint=str(ckpt)), data=DataConfig(train_file=str(train)),
                     rewards=[lambda prompt, completion, **_: 0.0])


@pytest.mark.parametrize(
    "train, parallel, field",
    [
        (
            dict(loss=LossConfig(objective="dr_grpo", scale_advantages_by_std=True)),
            {},
            "train.loss.scale_advantages_by_std",
        ),
        (dict(loss=LossConfig(objective="dr_grpo", aggregation="token-mean")), {}, "train.loss.aggregation"),
        (dict(loss=LossConfig(objective="gspo", clip_eps_high=0.3)), {}, "train.loss.gspo_clip_eps"),
        (dict(loss=LossConfig(gspo_clip_eps=(0.0, 0.1))), {}, "train.loss.gspo_clip_eps"),
        (dict(loss=LossConfig(objective="cispo", clip_eps_high=-1.0)), {}, "train.loss.clip_eps_high"),
        (dict(loss=LossConfig(entropy_coef=math.inf)), {}, "train.loss.entropy_coef"),
        (dict(loss=LossConfig(length_norm=0)), {}, "train.loss.length_norm"),
        (dict(off_policy=OffPolicyConfig(cap=0.0)), {}, "train.off_policy.cap"),
        (dict(off_policy=OffPolicyConfig(low=3.0)), {}, "train.off_policy.low"),
        (
            dict(off_policy=OffPolicyConfig(correction="tis_token", decoupled_loss=True)),
            {},
            "train.off_policy.decoupled_loss=false",
        ),
        (
            dict(off_policy=OffPolicyConfig(correction="mis_token"), minibatches=2),
            dict(dp_shard=2),
            "train.minibatches=1",
        ),
        (dict(loss=LossConfig(objective="gspo")), dict(pp=2, cp=2), "train.loss.objective='gspo'"),
        (
            dict(off_policy=OffPolicyConfig(correction="mis_geometric")),
            dict(pp=2, cp=2),
            "train.off_policy.correction='mis_geometric'",
        ),
    ],
)
def test_validation_names_the_field(run_config, train, parallel, field):
    """Inconsistent loss settings fail validation with an error naming the field to change."""
    from titanrl.config import ParallelConfig
    from titanrl.config.validation import validate
    from titanrl.errors import ConfigError

    run_config.rollout.prompts_per_step = 2
    run_config.train = TrainConfig(**train, parallel=ParallelConfig(**parallel))
    with pytest.raises(ConfigError) as info:
        validate(run_config)
    assert field in str(info.value), str(info.value)


def test_validation_accepts_the_variants(run_config):
    """Each loss, aggregation and correction on its own validates (with one trainer process)."""
    from titanrl.config.validation import validate

    for kw in [
        dict(loss=LossConfig(objective="dr_grpo")),
        dict(loss=LossConfig(objective="dapo")),
        dict(loss=LossConfig(objective="gspo")),
        dict(loss=LossConfig(objective="cispo", clip_eps_high=3.0)),
        dict(loss=LossConfig(aggregation="seq-mean-token-mean", entropy_coef=0.01)),
        dict(off_policy=OffPolicyConfig(correction="mis_sequence", low=0.1), ppo_epochs=2),
    ]:
        run_config.train = TrainConfig(**kw)
        validate(run_config)  # raises ConfigError on refusal
        resolved = loss_settings(run_config.train)
        assert resolved.loss == run_config.train.loss.objective
        assert resolved.correction == run_config.train.off_policy.correction
        if run_config.train.loss.aggregation is not None:
            assert resolved.aggregation == run_config.train.loss.aggregation


def test_driver_resolves_the_length_norm(run_config):
    """train.loss.length_norm None becomes rollout.sampling.max_new_tokens in the resolved config the trainer gets."""
    from titanrl.config.resolve import resolve

    run_config.rollout.sampling.max_new_tokens = 24
    assert resolve(run_config).config.train.loss.length_norm == 24
    run_config.train.loss.length_norm = 7
    assert resolve(run_config).config.train.loss.length_norm == 7
