"""Prompt datasets (load_rows, PromptStream), the run-directory logger, plots and run-dir safety."""

from __future__ import annotations

import json

import pytest

from titanrl.config import ConfigError
from titanrl.data import DatasetError, PromptStream, load_rows, write_rows
from titanrl.rundir.metrics import MetricsLogger, read_metrics

# ----------------------------------------------------------------------------- load_rows


def test_load_rows_reads_rows_and_skips_blank_lines(tmp_path):
    """Valid rows come back in file order with all their fields; blank lines are ignored."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2}\n')
    assert load_rows(path) == [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}]


def test_write_rows_round_trips(tmp_path):
    """write_rows output (into a new folder) reads back identical through load_rows."""
    rows = [{"prompt": f"q{i}", "x": [i, i + 1]} for i in range(5)]
    path = tmp_path / "sub" / "rows.jsonl"
    write_rows(path, rows)
    assert load_rows(path) == rows


def test_load_rows_bad_json_names_file_and_line(tmp_path):
    """A malformed line is reported as file:line."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b",,}\n')
    with pytest.raises(DatasetError) as info:
        load_rows(path)
    assert f"{path}:2" in str(info.value) and "not valid JSON" in str(info.value)


def test_load_rows_missing_prompt_field_names_line_and_field(tmp_path):
    """A row without the prompt field names file:line, the field, and the config key to change."""
    path = tmp_path / "noprompt.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"question": "b"}\n')
    with pytest.raises(DatasetError) as info:
        load_rows(path)
    msg = str(info.value)
    assert f"{path}:3" in msg and "'prompt'" in msg and "data.prompt_field" in msg


@pytest.mark.parametrize("line", ['{"prompt": 3}', '["prompt"]', '"just a string"'])
def test_load_rows_rejects_non_string_prompt_or_non_object(tmp_path, line):
    """Rows must be JSON objects with a string prompt."""
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DatasetError, match=rf"{path.name}:1"):
        load_rows(path)


def test_load_rows_custom_prompt_field(tmp_path):
    """data.prompt_field picks the key that must hold the prompt."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a"}\n')
    assert load_rows(path, prompt_field="question") == [{"question": "a"}]
    with pytest.raises(DatasetError):
        load_rows(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_load_rows_empty_file(tmp_path, content):
    """A file without rows (empty or only blank lines) is an error naming the file."""
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match="has no rows") as info:
        load_rows(path)
    assert str(path) in str(info.value)


# ----------------------------------------------------------------------------- PromptStream


def _rows(n):
    return [{"prompt": f"p{i}", "i": i} for i in range(n)]


def _draw(stream, batches):
    return [row["i"] for _ in range(batches) for row in stream.next_batch()]


def test_prompt_stream_reproducible_with_seed():
    """Two streams with the same seed yield the same batches; another seed yields a different order."""
    a = _draw(PromptStream(_rows(10), 4, seed=7), 6)
    b = _draw(PromptStream(_rows(10), 4, seed=7), 6)
    c = _draw(PromptStream(_rows(10), 4, seed=8), 6)
    assert a == b
    assert a != c


def test_prompt_stream_covers_every_row_once_per_epoch():
    """Each consecutive run of len(rows) draws is a permutation, even when batches straddle epochs."""
    n, bs = 10, 4
    stream = PromptStream(_rows(n), bs, seed=1)
    drawn = _draw(stream, 8)  # 32 rows: three full epochs + 2
    assert all(len(b) == bs for b in [drawn[i : i + bs] for i in range(0, 32, bs)])
    epochs = [drawn[k * n : (k + 1) * n] for k in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # reshuffled each epoch
    assert stream.epoch == 3


def test_prompt_stream_batch_larger_than_dataset():
    """A batch bigger than the dataset spans epochs and still returns batch_size rows."""
    stream = PromptStream(_rows(3), 7, seed=0)
    batch = [r["i"] for r in stream.next_batch()]
    assert len(batch) == 7
    assert sorted(batch[:3]) == [0, 1, 2] and sorted(batch[3:6]) == [0, 1, 2]


# ----------------------------------------------------------------------------- MetricsLogger


def test_metrics_logger_one_json_object_per_line_flushed(tmp_path):
    """Each log() appends one JSON line readable before close; non-finite floats become null."""
    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    logger.log({"step": 1, "loss": 0.5, "reward/mean": 0.25})
    logger.log({"step": 2, "loss": float("nan"), "reward/mean": float("inf"), "note": "x"})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()  # not closed yet
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {"step": 1, "loss": 0.5, "reward/mean": 0.25}
    assert second == {"step": 2, "loss": None, "reward/mean": None, "note": "x"}
    assert read_metrics(tmp_path / "run") == [first, second]
    logger.close()


def test_metrics_logger_rollouts(tmp_path):
    """log_rollouts writes one JSON line per row, tagged with the step, flushed."""
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log_rollouts(3, [{"prompt": "a", "reward": 1.0}, {"prompt": "b", "reward": 0.0}])
    rows = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rows == [{"step": 3, "prompt": "a", "reward": 1.0}, {"step": 3, "prompt": "b", "reward": 0.0}]
    logger.close()


def test_metrics_logger_tensorboard_events(tmp_path):
    """With tensorboard=True, numeric metrics land as TensorBoard scalars at their step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log({"step": 1, "loss": 0.5, "flag": True, "name": "x", "missing": None})
    logger.log({"step": 2, "loss": 0.25})
    logger.close()
    tb = tmp_path / "tensorboard"
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["loss"]  # bools, strings and None are not scalars
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


def test_metrics_logger_without_tensorboard_writes_no_events(tmp_path):
    """tensorboard=False writes no event directory."""
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert not (tmp_path / "tensorboard").exists()
