"""`driver.pt` holds plain data only: both rollout sources' checkpoints survive a write and a
`torch.load(weights_only=True)` equal, a file of the old pickled-classes format is refused with
a message naming its format, and what cannot be stored plainly is refused where it is written.
(The end-to-end exact-resume tests in test_cli.py, test_robust_runs.py and
test_continuous_runs.py resume real runs from these files.)"""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from titanrl.driver.sources.buffer import BufferState, GroupTask
from titanrl.driver.sources.lockstep import QueueCheckpoint, Request
from titanrl.rundir.checkpoints import RunCheckpointError
from titanrl.rundir.driver_state import DRIVER_STATE, FORMAT_VERSION, read_driver_state, write_driver_state
from titanrl.rundir.plain import from_plain, to_plain
from titanrl.trainer.checkpoint import rng_state
from titanrl.types import Group, RolloutBatch, Sample


def _sample(i: int, **extra) -> Sample:
    return Sample(f"{i}+{i % 7}=", str(i + i % 7), [1, 2, i], [5, 6], [-0.5, -0.25], 1.0, i // 2, 3,
                  fields={"answer": i + i % 7, "tags": ["a", "b"]}, **extra)


def _group(i: int) -> Group:
    return Group([
        _sample(i),
        _sample(i, finished=False, loss_mask=[1, 0], stats={"turns": 2.0}, reward_error="ValueError: x",
                token_versions=[3, 4], turns=[{"role": "model", "text": "1"}, {"role": "env", "text": "2"}]),
    ])


def _stream_state() -> dict:
    rng = random.Random(5)
    return {"rng": rng.getstate(), "order": [3, 1, 2], "epoch": 1, "rows": 4}


def _lockstep() -> QueueCheckpoint:
    request = Request(index=2, first_group_id=8, policy_version=1, stream_state=_stream_state())
    batch = RolloutBatch([_group(0), _group(1)], gen_tokens=8, gen_seconds=0.5, policy_version=1, reward_seconds=0.1)
    return QueueCheckpoint([(request, [batch])], next_index=3, next_group_id=12, stream_state=_stream_state(),
                           exact=True)


def _continuous() -> BufferState:
    tasks = [(GroupTask(4, {"prompt": "4+4=", "answer": 8}, seed=11, step=2, min_version=1, attempts=2), _group(4)),
             (GroupTask(5, {"prompt": "5+5=", "answer": 10}, seed=12, step=2, min_version=1), None)]
    return BufferState(tasks, next_step=3, stream_state=_stream_state())


@pytest.mark.parametrize("make", [_lockstep, _continuous], ids=["lockstep", "continuous"])
def test_source_checkpoints_round_trip_through_a_weights_only_load(tmp_path, make):
    """A source's checkpoint written as driver.pt loads with torch.load(weights_only=True) and
    rebuilds equal to what was saved (nested dataclasses, tuples, optional groups, RNG states)."""
    saved = make()
    write_driver_state(tmp_path / DRIVER_STATE, {"step": 2, "policy_version": 1, "exact": saved.exact,
                                                 "rollouts": to_plain(saved), "rng": rng_state()})
    raw = torch.load(tmp_path / DRIVER_STATE, weights_only=True)
    assert raw["format_version"] == FORMAT_VERSION
    state = read_driver_state(tmp_path)
    rebuilt = from_plain(type(saved), state["rollouts"])
    assert rebuilt == saved
    assert rebuilt.stream_state["rng"] == saved.stream_state["rng"]  # random.setstate needs the tuples back
    assert state["exact"] is saved.exact


def test_a_driver_state_of_the_old_pickled_format_is_refused_with_its_format_named(tmp_path):
    """driver.pt as TitanRL wrote it before format_version (torch.save of the dataclasses
    themselves) is refused, naming format 0 and what to do, instead of unpickling classes."""
    torch.save({"step": 2, "policy_version": 1, "queue": _lockstep(), "rng": {}}, tmp_path / DRIVER_STATE)
    with pytest.raises(RunCheckpointError, match=r"older TitanRL \(driver.pt format 0.*resume it with that "
                                                 r"version or start a new run"):
        read_driver_state(tmp_path)


def test_a_driver_state_of_another_format_version_is_refused(tmp_path):
    """A plain driver.pt with a format_version this TitanRL does not write is refused by number."""
    torch.save({"format_version": FORMAT_VERSION + 1, "step": 1}, tmp_path / DRIVER_STATE)
    with pytest.raises(RunCheckpointError, match=f"format {FORMAT_VERSION + 1}; this TitanRL reads format"):
        read_driver_state(tmp_path)


def test_what_is_not_plain_data_is_refused_naming_where_it_is():
    """A value that would need a class to unpickle (here a lock in a dataset row) is refused when
    written, naming its place in the state, rather than making the file unreadable later."""
    import threading

    bad = GroupTask(1, {"prompt": "1+1=", "lock": threading.Lock()}, seed=1, step=1, min_version=0)
    with pytest.raises(TypeError, match=r"rollouts\.row\['lock'\]"):
        to_plain(bad, "rollouts")
    assert pickle.dumps(to_plain(GroupTask(1, {"prompt": "1+1="}, 1, 1, 0)))  # the plain form stores


def test_resuming_a_run_of_the_old_format_is_refused_before_start_up(tmp_path, monkeypatch):
    """`titanrl.train(config, resume=True)` on a run whose newest checkpoint has a format-0
    driver.pt stops with the format message before Ray or any actor is started."""
    import titanrl
    import titanrl.driver.train
    from titanrl.data import write_rows
    from titanrl.models.tiny import write_tiny_checkpoint
    from titanrl.rundir.checkpoints import writing_checkpoint
    from titanrl.rundir.layout import create_run_dir

    write_rows(tmp_path / "train.jsonl", [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(8)])
    config = titanrl.RunConfig(
        model=titanrl.ModelConfig(checkpoint=str(write_tiny_checkpoint(tmp_path / "ckpt"))),
        data=titanrl.DataConfig(train_file=str(tmp_path / "train.jsonl")),
        rollout=titanrl.RolloutConfig(
            prompts_per_step=2,
            group_size=2,
            sampling=titanrl.SamplingConfig(max_new_tokens=4),
            engine=titanrl.EngineConfig(max_model_len=64),
        ),
        output=titanrl.OutputConfig(dir=str(tmp_path / "run"), progress_bar=False),
        rewards=[_zero],
    )
    run_dir = create_run_dir(config)
    with writing_checkpoint(run_dir, 2, {"policy_version": 1, "exact": True}) as tmp:
        torch.save({"step": 2, "policy_version": 1, "queue": _lockstep(), "rng": {}}, tmp / DRIVER_STATE)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a run that cannot resume")

    monkeypatch.setattr(titanrl.driver.train, "init_ray", no_ray)
    with pytest.raises(RunCheckpointError, match=r"saved by an older TitanRL \(driver.pt format 0"):
        titanrl.train(config, resume=True)


def _zero(prompt: str, completion: str, **fields) -> float:
    return 0.0
