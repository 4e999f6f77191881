"""One lock-step run with the reward toolbox switched on (real Ray, real vLLM, the tiny model): a
per-sample, an async batched and a built-in reward with weights, dynamic sampling, overlong filtering
and the soft overlong penalty. Their metrics reach metrics.jsonl and agree with each other."""

from __future__ import annotations

import asyncio

import pytest

import titanrl
from titanrl.rewards import exact_match


def _odd(prompt: str) -> bool:
    return int(prompt.split("+")[0]) % 2 == 1


def digits(prompt: str, completion: str, **fields) -> float:
    """The digit share, except 0 on odd prompts: their groups are all equal (dynamic sampling replaces them)."""
    return 0.0 if _odd(prompt) else sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


@titanrl.batched_reward
async def short(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    await asyncio.sleep(0)
    return [0.0 if _odd(p) else float(len(c) <= 4) for p, c in zip(prompts, completions)]


@pytest.mark.slow
def test_reward_toolbox_run(tmp_path, ray_session, tiny_run):
    """Per step: reward/mean = sum of weight * reward/<name>/mean + reward/overlong_penalty/mean (no
    errors, so the total is linear in the terms); every masked sample is a truncated one; dynamic
    sampling's counts add up; the health metrics are present and in range."""
    weights = [1.0, 0.5, 2.0]
    config = titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(tiny_run.checkpoint)),
        data=titanrl.DataConfig(train_file=str(tiny_run.train_file), eval_file=str(tiny_run.eval_file(4))),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=4,
            group_size=4,
            sampling=titanrl.SamplingConfig(max_new_tokens=8),
            engine=titanrl.EngineConfig(max_model_len=64),
            shaping=titanrl.ShapingConfig(
                dynamic_sampling=True,
                dynamic_sampling_max_requests=2,
                overlong_filter=True,
                overlong_buffer=4,
                overlong_penalty=0.5,
            ),
        ),
        train=titanrl.TrainConfig(steps=2, optimizer=titanrl.OptimizerConfig(lr=3e-3)),
        eval=titanrl.EvalConfig(every_steps=1, correct_threshold=0.5),
        output=titanrl.OutputConfig(dir=str(tmp_path / "run"), progress_bar=False, save_every_steps=0),
        rewards=[digits, short, exact_match],
        reward_weights=weights,
        scoring=titanrl.ScoringConfig(health=titanrl.RewardHealthConfig(agreement_pairs=["digits:exact_match"])),
    )
    result = titanrl.train(config)
    steps = [m for m in result.metrics if m["step"] > 0 and "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["reward/errors"] == 0
        names = ["digits", "short", "exact_match"]
        total = sum(w * m[f"reward/{n}/mean"] for w, n in zip(weights, names)) + m["reward/overlong_penalty/mean"]
        assert m["reward/mean"] == pytest.approx(total, abs=1e-9)
        assert all(m[f"reward/{n}/errors"] == 0 and m[f"reward/{n}/seconds"] >= 0 for n in names)
        assert m["rollout/overlong_filtered"] == round(m["completion/truncated_frac"] * 16)
        assert -0.5 <= m["reward/overlong_penalty/mean"] <= 0
        assert m["rollout/dynamic_sampling/extra_requests"] <= 2
        # Places still held by all-equal groups are exactly the unfilled ones.
        assert m["reward/zero_variance_groups"] * 4 == m["rollout/dynamic_sampling/unfilled"]
        assert 0 <= m["reward/agreement/digits_vs_exact_match"] <= 1
    # Odd prompts' groups are all equal: some step drew one and had it replaced (or kept it, unfilled).
    assert sum(m["rollout/dynamic_sampling/replaced"] + m["rollout/dynamic_sampling/unfilled"] for m in steps) >= 1
