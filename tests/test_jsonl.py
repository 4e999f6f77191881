"""The one JSON-lines reader (`titanrl.jsonl`) and its rule for a line cut short by a crash."""

import logging

import pytest

from titanrl.data import DatasetError, load_rows
from titanrl.jsonl import JsonLinesError, read_json_lines
from titanrl.rundir.metrics import read_metrics


def test_a_cut_short_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    """A last line with no newline that is not JSON (a crash mid-append) is skipped, named in a
    warning with file and line, and kept as `cut_short`; every complete line before it is read."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="titanrl"):
        found = read_json_lines(path)
    assert found.values() == [{"step": 1}, {"step": 2}]
    assert [line.number for line in found.lines] == [1, 3]
    assert found.cut_short == '{"step": 3, "lo'
    assert f"{path}:4" in caplog.text and "incomplete last line" in caplog.text
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]  # the run directory's reader follows it


def test_a_bad_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path):
    """A line that is not JSON but has a newline after it (not a crash's tail) raises, naming file:line."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2,,}\n{"a": 3}')
    with pytest.raises(JsonLinesError, match=rf"{path}:2 is not valid JSON"):
        read_json_lines(path)


def test_a_bad_last_line_with_its_newline_is_an_error(tmp_path):
    """A complete (newline-terminated) last line that is not JSON is damage, not a cut-short write."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(JsonLinesError, match=rf"{path}:2 is not valid JSON"):
        read_json_lines(path)


def test_callers_choose_the_error_type_and_datasets_follow_the_rule(tmp_path):
    """load_rows raises its DatasetError for a bad middle line and skips a cut-short last one."""
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"')
    assert load_rows(path) == [{"prompt": "a"}]
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:2 is not valid JSON"):
        load_rows(path)
