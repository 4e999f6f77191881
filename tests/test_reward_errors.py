"""Bad rewards and broken environments cost one sample, never the run; sampling seeds are unique.

The scorer the workers use (`RewardScorer`) is unit-tested with small reward functions (they
are the user code under test's input), one sample per call here (test_reward_concurrency.py
scores batches). The worker and episode tests use one real in-process RolloutWorker (its vLLM engine
also drives the episodes) with rewards and scripted environments whose behaviour each row picks.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.config import (
    EngineConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    ScoringConfig,
)
from titanrl.config.resolve import resolve
from titanrl.envs.base import Environment, StepResult
from titanrl.rewards.batch_scoring import HELPER_NAME, RewardScorer, ToScore
from titanrl.rewards.scoring import eval_summary
from titanrl.rollout.seeds import episode_seed, request_seed, sample_seed
from titanrl.trainer.batch import pack
from titanrl.types import Group


def _score(*rewards, timeout_s=None, error_value=-1.0, prompt="1+2=", fields=None):
    """One completion ("3") scored by a fresh `RewardScorer`: inline without a timeout, on a helper thread with one."""
    scorer = RewardScorer(list(rewards), timeout_s=timeout_s, error_value=error_value, concurrency=1)
    try:
        (result,) = scorer.score([ToScore(prompt, "3", fields or {})])
    finally:
        scorer.close()
    return result


def _const(value: Any):
    def bad_type(prompt, completion, **fields):
        return value

    return bad_type


# --- the scorer ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    1, 0.5, -2, Fraction(1, 3), np.float32(0.1), np.float16(0.3), np.int64(7), np.uint8(3),
    np.array(0.25), np.array(0.1, dtype=np.float32), np.array(4, dtype=np.int32),
    torch.tensor(0.3), torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.7, dtype=torch.bfloat16),
    torch.tensor(5),
], ids=repr)
@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_any_real_scalar_is_accepted_exactly(value, timeout_s):
    """Python numbers, numpy scalars and 0-d arrays, and 0-d torch tensors of integer or float dtype
    are rewards: the sample gets exactly their value as a float, with no error (inline and threaded)."""
    expected = float(value.item()) if hasattr(value, "item") else float(value)
    assert _score(_const(value), timeout_s=timeout_s) == (expected, None)


def test_rewards_sum_and_sync_async_mix():
    """Several rewards (sync, async, callable object with async __call__) add up; the fields reach them."""

    async def async_part(prompt, completion, answer, **fields):
        await asyncio.sleep(0)
        return 0.25 if completion == answer else 0.0

    class Scaled:
        async def __call__(self, prompt, completion, **fields):
            return np.float32(0.5)

    reward, error = _score(lambda p, c, **f: 1, async_part, Scaled(), fields={"answer": "3"}, timeout_s=1.0)
    assert error is None and reward == 1.75


@pytest.mark.parametrize("exc,text", [
    (ValueError("bad answer"), "raised ValueError: bad answer"),
    (KeyError("answer"), "raised KeyError: 'answer'"),
    (TimeoutError("my own"), "raised TimeoutError: my own"),  # the reward's own, not our deadline
    (RuntimeError(), "raised RuntimeError: (no message)"),
])
@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_raising_reward_gives_error_value_not_a_partial_sum(exc, text, timeout_s):
    """A raising reward gives the sample error_value (not the sum of the rewards that worked),
    names the reward, the exception and the prompt, and the rewards after it are not called."""
    later = []

    def exact_answer(prompt, completion, **fields):
        raise exc

    reward, error = _score(_const(1.0), exact_answer, lambda *a, **k: later.append(1) or 1.0, timeout_s=timeout_s)
    assert reward == -1.0 and later == []
    name = "test_raising_reward_gives_error_value_not_a_partial_sum.<locals>.exact_answer"
    assert error == f"reward {name} {text} (prompt '1+2=')"


@pytest.mark.timeout(60)  # a hang guard only
def test_sync_reward_timeout_abandons_its_thread():
    """A sync reward running past timeout_s is abandoned: the sample gets error_value and a
    'timed out' error while the reward's thread is still running (a Python thread cannot be
    killed); the scorer's next call runs on a fresh helper, and the abandoned one exits once its
    call returns."""
    release, done = threading.Event(), threading.Event()

    def slow_reward(prompt, completion, **fields):
        if prompt == "slow":
            release.wait(60)
            done.set()
            return 1.0
        return 2.0

    before = set(_helpers())
    scorer = RewardScorer([slow_reward], timeout_s=0.2, error_value=-1.0, concurrency=1)
    try:
        (reward, error), = scorer.score([ToScore("slow", "3", {})])
        name = "test_sync_reward_timeout_abandons_its_thread.<locals>.slow_reward"
        assert (reward, error) == (-1.0, f"reward {name} timed out after 0.2 s (prompt 'slow')")
        assert not done.is_set()  # returned while the reward still runs: it was not waited for
        assert scorer.score([ToScore("1+2=", "3", {})]) == [(2.0, None)]  # one slot, so a fresh helper
        helpers = set(_helpers()) - before
        assert len(helpers) == 2
        release.set()
        assert done.wait(30)
        while sum(t.is_alive() for t in helpers) > 1:  # the abandoned one is on its way out
            time.sleep(0.01)
        assert sum(t.is_alive() for t in helpers) == 1  # the live one stays, idle, for the next call
    finally:
        release.set()
        scorer.close()


def _helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == HELPER_NAME]


@pytest.mark.timeout(60)  # a hang guard only
def test_async_reward_timeout_cancels_it():
    """An async reward past timeout_s is cancelled through asyncio.wait_for and gets error_value,
    also one that awaits a blocking call in a thread (asyncio.to_thread): the scorer returns,
    and closes, while that thread is still blocked (it is not joined)."""
    cancelled = []

    async def slow_async(prompt, completion, **fields):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 1.0

    release, unblocked = threading.Event(), threading.Event()

    def blocking() -> None:
        release.wait(60)
        unblocked.set()

    async def to_thread_reward(prompt, completion, **fields):
        await asyncio.to_thread(blocking)
        return 1.0

    try:
        for fn in (slow_async, to_thread_reward):
            reward, error = _score(fn, timeout_s=0.2)
            assert reward == -1.0
            assert error.endswith(f"{fn.__name__} timed out after 0.2 s (prompt '1+2=')")
        assert cancelled == [True]
        assert not unblocked.is_set()
    finally:
        release.set()


@pytest.mark.parametrize("value,text", [
    (float("nan"), "returned nan"), (float("inf"), "returned inf"), (-math.inf, "returned -inf"),
    (np.float32("nan"), "returned nan"), (np.array(np.inf), "returned inf"),
    (torch.tensor(float("nan")), "returned nan"),
], ids=repr)
def test_non_finite_reward_is_an_error(value, text):
    """NaN and infinities (any numeric type) give error_value and say what was returned."""
    assert _score(_const(value), error_value=0.0) == (0.0, f"reward _const.<locals>.bad_type {text} (prompt '1+2=')")


@pytest.mark.parametrize("value,text", [
    (None, "returned None (NoneType); it must return a real number"),
    ("1.0", "returned '1.0' (str); it must return a real number"),
    ([1.0], "returned [1.0] (list)"),
    (1 + 0j, "returned (1+0j) (complex)"),
    (True, "returned a bool; return a float (e.g. float(ok))"),
    (np.bool_(True), "numpy value of shape () and dtype bool"),
    (np.array([1.0]), "numpy value of shape (1,) and dtype float64"),
    (torch.tensor([1.0, 2.0]), "tensor of shape (2,) and dtype torch.float32"),
    (torch.tensor([1.0]), "tensor of shape (1,) and dtype torch.float32"),
    (torch.tensor(True), "tensor of shape () and dtype torch.bool"),
    (10**400, "which does not fit in a float"),
], ids=repr)
def test_non_number_is_rejected_naming_the_reward(value, text):
    """Anything but one real scalar is an error whose message names the reward and what it returned;
    bool is rejected as everywhere in TitanRL (float(ok) states the intent)."""
    reward, error = _score(_const(value))
    assert reward == -1.0
    assert error.startswith("reward _const.<locals>.bad_type ") and text in error and error.endswith("(prompt '1+2=')")


def test_sum_overflow_is_an_error():
    """Two finite rewards whose sum overflows to inf give error_value, not inf."""
    reward, error = _score(_const(1e308), _const(1e308))
    assert reward == -1.0 and "rewards summed to inf" in error


def test_async_reward_inside_running_loop_is_a_caller_error():
    """Calling the scorer from inside an event loop is the caller's bug: it raises, it is not
    recorded as the reward's failure."""

    async def fine(prompt, completion, **fields):
        return 1.0

    async def main():
        return _score(fine)

    with pytest.raises(RuntimeError, match="running event loop"):
        asyncio.run(main())


def test_eval_summary_never_counts_an_errored_sample_correct():
    """An errored sample's error_value can pass the threshold; it is still not correct."""
    out = eval_summary([1.0, 1.0, 0.0], 1.0, 3, ["reward r raised ValueError: x", None, None])
    assert out == {"rewards": [1.0, 1.0, 0.0], "correct": 1, "reward_errors": 1, "policy_version": 3}


def test_pack_copes_with_an_empty_completion():
    """A sample of a failed episode (prompt only, empty completion) packs next to a normal one:
    it contributes no loss tokens and leaves the other row exactly as when packed alone."""
    from titanrl.types import Sample

    ok = Sample("p", "c", [5, 6, 7], [8, 9], [-0.5, -0.25], 1.0, 0, 0)
    failed = Sample("p", "", [5, 6], [], [], 0.0, 0, 0, loss_mask=[], reward_error="environment reset raised")
    both, alone = pack([Group([ok, failed])], pad_id=0), pack([Group([ok, ok])], pad_id=0)
    assert both.loss_mask_BT[1].sum() == 0
    assert torch.equal(both.loss_mask_BT[0], alone.loss_mask_BT[0])
    assert torch.equal(both.targets_BT[0], alone.targets_BT[0])
    assert torch.equal(both.old_logprobs_BT[0], alone.old_logprobs_BT[0])


# --- seeds ----------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    run_seed=st.integers(-(2**40), 2**40),
    group_size=st.integers(1, 6),
    max_turns=st.integers(1, 4),
    workers=st.integers(1, 4),
    requests=st.lists(st.integers(1, 7), min_size=1, max_size=6),
)
def test_request_seed_gives_every_sample_turn_its_own_seed(run_seed, group_size, max_turns, workers, requests):
    """Simulating the driver (requests of k prompts split round-robin over workers, consecutive
    group ids), every (group, sample, turn) of a run gets a different seed in [0, 2**63), and it
    is the one `sample_seed` names; single-turn (engine: seed + j*n + i) and episodes
    (episode_seed + turn) both follow that layout."""
    seeds: dict[int, tuple[int, int, int]] = {}
    next_group = 0
    for k in requests:
        rows = list(range(k))
        for chunk in (rows[w::workers] for w in range(workers)):
            if not chunk:
                continue
            seed = request_seed(run_seed, next_group, group_size, max_turns)
            for j in range(len(chunk)):
                for i in range(group_size):
                    for turn in range(max_turns):
                        if max_turns == 1:
                            s = seed + j * group_size + i  # VllmEngine's prompt offset + vLLM's sample offset
                        else:
                            s = episode_seed(seed, j * group_size + i, max_turns) + turn
                        key = (next_group + j, i, turn)
                        assert s not in seeds, f"{key} reuses the seed of {seeds[s]}"
                        assert 0 <= s < 2**63
                        assert s == sample_seed(run_seed, *key[:2], group_size, max_turns, turn)
                        seeds[s] = key
            next_group += len(chunk)
    assert len(seeds) == next_group * group_size * max_turns


def test_request_seed_rejects_bad_arguments():
    """Wrong types and ranges name the argument; a run past its seed space is refused."""
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        request_seed(0, 0, 0)
    with pytest.raises(TypeError, match="max_turns must be an int"):
        request_seed(0, 0, 2, True)
    with pytest.raises(ValueError, match="first_group_id must be >= 0"):
        request_seed(0, -1, 2)
    with pytest.raises(ValueError, match="exceeds the 2\\*\\*42 seeds"):
        request_seed(0, 2**40, 8, 1)


# --- a real RolloutWorker -------------------------------------------------------------------
ERROR_VALUE = 0.5


def mode_reward(prompt: str, completion: str, mode: str, **fields: Any) -> Any:
    """Behaves as the row's `mode` says: the rows of one request exercise every failure at once."""
    if mode == "raise":
        raise ValueError("no answer found")
    if mode == "slow":
        time.sleep(1.0)
    if mode == "nan":
        return float("nan")
    if mode == "tensor":
        return torch.tensor(0.25)
    if mode == "none":
        return None
    return 1.0


@pytest.fixture(scope="module")
def worker(vllm_tiny_checkpoint):
    """One in-process RolloutWorker with `mode_reward`, a 0.3 s reward timeout and error value 0.5."""
    from titanrl.rollout.worker import RolloutWorker

    rc = RolloutConfig(group_size=2, sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
                       engine=EngineConfig(max_model_len=256, max_num_seqs=32))
    config = RunConfig(model=ModelConfig(checkpoint=str(vllm_tiny_checkpoint)), rollout=rc, rewards=[mode_reward],
                       scoring=ScoringConfig(timeout_s=0.3, error_value=ERROR_VALUE))
    w = RolloutWorker(0, resolve(config))
    yield w
    w.close()


MODES = ["ok", "raise", "slow", "nan", "tensor", "none"]


@pytest.mark.own_vllm_engine
def test_worker_generate_and_evaluate_survive_bad_rewards(worker):
    """generate gives errored samples error_value and a reward_error naming reward and cause, the
    others their reward; evaluate never raises and never counts an errored sample correct
    (error_value 0.5 meets the 0.5 threshold)."""
    rows = [{"prompt": f"{m} 1+2=", "mode": m} for m in MODES]
    batch = worker.generate(rows, request_seed(0, 10, 2), first_group_id=10)
    assert [g.samples[0].group_id for g in batch.groups] == list(range(10, 16))
    expected = {
        "ok": (1.0, None), "tensor": (0.25, None),
        "raise": (ERROR_VALUE, "reward mode_reward raised ValueError: no answer found (prompt 'raise 1+2=')"),
        "slow": (ERROR_VALUE, "reward mode_reward timed out after 0.3 s (prompt 'slow 1+2=')"),
        "nan": (ERROR_VALUE, "reward mode_reward returned nan (prompt 'nan 1+2=')"),
        "none": (ERROR_VALUE, "reward mode_reward returned None (NoneType); it must return a real number "
                              "(prompt 'none 1+2=')"),
    }
    for mode, group in zip(MODES, batch.groups, strict=True):
        assert [(s.reward, s.reward_error) for s in group.samples] == [expected[mode]] * 2, mode
    out = worker.evaluate(rows, max_new_tokens=4, correct_threshold=0.5)
    assert out["rewards"] == [1.0, ERROR_VALUE, ERROR_VALUE, ERROR_VALUE, 0.25, ERROR_VALUE]
    assert out["correct"] == 1 and out["reward_errors"] == 4


@pytest.mark.own_vllm_engine
def test_worker_sample_uses_its_own_seed(worker):
    """Sample i of group g in a worker request samples the same tokens as a lone request seeded
    with sample_seed(run, g, i): the request_seed layout is what the engine really uses."""
    rows = [{"prompt": "seed a", "mode": "ok"}, {"prompt": "seed b", "mode": "ok"}]
    batch = worker.generate(rows, request_seed(7, 4, 2), first_group_id=4)
    for g, group in enumerate(batch.groups, start=4):
        for i, sample in enumerate(group.samples):
            (alone,) = worker.engine.generate([sample.prompt], n=1, temperature=1.0, max_tokens=6,
                                              seed=sample_seed(7, g, i, 2), stop_token_ids=[worker.eos_id])[0]
            assert alone.token_ids == sample.completion_ids
            # Same tokens from the same seed; logprobs only up to batch-composition noise (~1e-6).
            assert alone.logprobs == pytest.approx(sample.gen_logprobs, abs=1e-5)


# --- environments ---------------------------------------------------------------------------
class ScriptedEnv(Environment):
    """Two turns: the first gets an observation and reward 0.3, the second ends with reward 0.7;
    the row's `mode` makes reset, step or close fail, or the reward a bad value."""

    instances: list[ScriptedEnv] = []

    def __init__(self) -> None:
        self.mode, self.steps, self.closed = "ok", 0, False
        ScriptedEnv.instances.append(self)

    async def reset(self, row):
        self.mode = row["mode"]
        if self.mode == "reset_raises":
            raise RuntimeError("reset broke")
        return row["prompt"]

    async def step(self, action):
        self.steps += 1
        if self.steps == 1:
            return StepResult(observation=" obs ", reward=0.3)
        if self.mode == "step_raises":
            raise ConnectionError("tool server gone")
        if self.mode == "step_nan":
            return StepResult(observation="", reward=float("nan"), done=True)
        if self.mode == "step_str":
            return StepResult(observation="", reward="0.7", done=True)  # type: ignore[arg-type]
        if self.mode == "step_none":
            return None
        return StepResult(observation="", reward=0.7, done=True, info={"tool_calls": 1})

    async def close(self):
        self.closed = True
        if self.mode == "close_raises":
            raise OSError("sandbox already gone")


def extra_reward(prompt: str, completion: str, mode: str, **fields: Any) -> float:
    """The env runner's optional extra reward; raises for rows in mode 'extra_raises'."""
    if mode == "extra_raises":
        raise ZeroDivisionError("division by zero")
    return 0.5


ENV_MODES = ["ok", "reset_raises", "step_raises", "step_nan", "step_str", "step_none", "close_raises", "extra_raises"]


@pytest.mark.own_vllm_engine
def test_env_errors_end_only_their_episode(worker):
    """Factory, reset, step, a non-finite or non-numeric step reward, a bad step result, close,
    and an extra reward raising each cost only their own episode: it gets error_value (not its
    partial reward), stats['errors'] counts env failures and reward_error says what happened; every
    other episode, including the other sample of the same group, completes normally. The batch
    packs for the trainer, and evaluate never counts an errored episode correct."""
    from titanrl.rollout.env_runner import EnvRunner

    calls = itertools.count()

    def make_env(context):
        if next(calls) == 1:  # the second episode (group 0, sample 1)
            raise ImportError("env module missing")
        return ScriptedEnv()

    ScriptedEnv.instances.clear()
    rc = RolloutConfig(group_size=2, sampling=SamplingConfig(max_new_tokens=4, temperature=1.0),
                       engine=EngineConfig(max_model_len=256))
    config = RunConfig(rollout=rc, env=EnvConfig(max_turns=3, max_total_tokens=64, sandbox_pool_size=0),
                       scoring=ScoringConfig(timeout_s=1.0, error_value=-1.0))
    runner = EnvRunner(worker.engine, make_env, config, [extra_reward], 0)
    try:
        rows = [{"prompt": f"{m}:", "mode": m} for m in ENV_MODES]
        batch = runner.generate(rows, request_seed(0, 0, 2, 3), first_group_id=0)
        expected_error = {
            "reset_raises": "environment reset raised RuntimeError: reset broke",
            "step_raises": "environment step raised ConnectionError: tool server gone",
            "step_nan": "environment step reward returned nan",
            "step_str": "environment step reward returned '0.7' (str); it must return a real number",
            "step_none": "environment step raised TypeError: step must return a StepResult, got NoneType",
            "close_raises": "environment close raised OSError: sandbox already gone",
            "extra_raises": "reward extra_reward raised ZeroDivisionError: division by zero (prompt 'extra_raises:')",
        }
        tokenizer = worker.engine.llm.get_tokenizer()
        for mode, group in zip(ENV_MODES, batch.groups, strict=True):
            for i, s in enumerate(group.samples):
                if mode == "ok" and i == 1:
                    assert s.reward == -1.0 and s.completion_ids == [] and s.stats["errors"] == 1
                    assert s.reward_error == "environment factory raised ImportError: env module missing"
                    assert s.prompt_ids == tokenizer.encode("ok:", add_special_tokens=False)
                elif mode == "ok":
                    assert (s.reward, s.reward_error, s.stats["errors"]) == (1.5, None, 0.0)  # 0.3 + 0.7 + 0.5
                    assert s.finished and s.stats["tool_calls"] == 1
                else:
                    assert s.reward == -1.0 and s.reward_error == expected_error[mode], mode
                    assert s.stats["errors"] == (0.0 if mode == "extra_raises" else 1.0), mode
                    assert s.finished == (mode == "extra_raises"), mode
                if mode == "reset_raises":
                    assert s.completion_ids == [] and s.gen_logprobs == [] and s.loss_mask == []
                    assert s.prompt_ids == tokenizer.encode("reset_raises:", add_special_tokens=False)
        assert len(ScriptedEnv.instances) == 2 * len(ENV_MODES) - 1 and all(e.closed for e in ScriptedEnv.instances)
        packed = pack(batch.groups, pad_id=0)
        assert packed.loss_mask_BT[2].sum() == 0 and packed.loss_mask_BT[3].sum() == 0  # reset failures
        assert packed.loss_mask_BT[0].sum() > 0
        out = runner.evaluate(rows, correct_threshold=-1.0)
        assert out["correct"] == 1 and out["reward_errors"] == len(ENV_MODES) - 1
    finally:
        runner.close()
