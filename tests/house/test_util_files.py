"""ckptstore.util.files: the one atomic replace and directory fsync."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptstore.util.files import fsync_dir, replace_durably, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "pointer.json"
    p.write_bytes(b"old")
    write_atomic(p, b"new", prefix=".tmp-")
    assert p.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["pointer.json"]


def test_a_failed_write_atomic_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    p = tmp_path / "pointer.json"
    p.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_atomic(p, "not bytes", prefix=".tmp-")  # type: ignore[arg-type]
    assert p.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["pointer.json"]


def test_replace_durably_renames_over_the_target(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    replace_durably(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == b"a" and not (tmp_path / "a").exists()
    fsync_dir(tmp_path)
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "b")
