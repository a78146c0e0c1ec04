"""`ckptstore ls` shows bytes written against bytes referenced on a version-3
run, and `ckptstore gc` reports pieces and bytes freed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptstore.backends.local import LocalBackend
from ckptstore.cli import main
from tests.incremental.common import FROZEN, RUN, open_store, save


def test_ls_and_gc_report_pieces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(LocalBackend(tmp_path / "s"))
    for step in (1, 2, 3):
        save(store, step)
    store.close()
    assert main(["ls", str(tmp_path / "s"), RUN]) == 0
    out = capsys.readouterr().out
    assert "written" in out and "referenced" in out
    assert main(["ls", str(tmp_path / "s"), RUN, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["bytes_written"] < rows[-1]["bytes_written"] == rows[-1]["bytes_referenced"]
    assert main(["gc", str(tmp_path / "s"), RUN, "--keep-last", "1", "--grace", "0", "--apply", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["pieces"]["freed"] >= 2 and rep["pieces"]["refused"] is None
    assert rep["pieces"]["bytes_freed"] > 0
    assert rep["pieces"]["bytes_freed"] < len(FROZEN)  # the backbone is kept: the newest save names it
