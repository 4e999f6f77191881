"""The one atomic directory replace (`titanrl.atomic_io.replacing_directory`)."""

import os

import pytest

from titanrl.atomic_io import replacing_directory, temporary_name, write_text_atomically


def test_replacing_directory_swaps_in_the_new_contents_and_leaves_no_temporaries(tmp_path):
    """A complete body replaces an existing directory's contents; nothing else is left beside it."""
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with replacing_directory(final) as tmp:
        assert tmp.parent == final.parent and tmp != final
        (tmp / "sub").mkdir()
        (tmp / "sub" / "new.txt").write_text("new")
        assert (final / "old.txt").read_text() == "old"  # untouched until the body returns
    assert sorted(p.relative_to(final).as_posix() for p in final.rglob("*")) == ["sub", "sub/new.txt"]
    assert os.listdir(tmp_path) == ["out"]


def test_a_failing_body_leaves_the_old_directory_intact(tmp_path):
    """An exception inside the body removes the temporary and keeps the previous directory as it was."""
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="crash"):
        with replacing_directory(final) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("crash")
    assert os.listdir(final) == ["old.txt"] and not temporary_name(final).exists()
    assert os.listdir(tmp_path) == ["out"]


def test_write_text_atomically_replaces_a_file(tmp_path):
    """The file variant replaces the file's text and leaves no temporary beside it."""
    path = tmp_path / "config.json"
    path.write_text("old")
    write_text_atomically(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["config.json"]
