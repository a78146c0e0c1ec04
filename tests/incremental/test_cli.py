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
    assert main(["report", str(tmp_path / "s"), RUN, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    per = {b["step"]: b for b in rec["save_bytes"]}
    assert per[1]["bytes_written"] == per[1]["bytes_referenced"] > per[3]["bytes_written"] > 0
    assert per[3]["bytes_referenced"] == per[1]["bytes_referenced"]
    assert main(["report", str(tmp_path / "s"), RUN]) == 0
    assert "bytes written / referenced per save" in capsys.readouterr().out
    assert main(["gc", str(tmp_path / "s"), RUN, "--keep-last", "1", "--grace", "0", "--apply", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["pieces"]["freed"] >= 2 and rep["pieces"]["refused"] is None
    assert rep["pieces"]["bytes_freed"] > 0
    assert rep["pieces"]["bytes_freed"] < len(FROZEN)  # the backbone is kept: the newest save names it


def test_a_save_in_progress_is_listed_and_a_gone_holder_is_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ckptstore import CheckpointStore, SaveState
    from tests.incremental.common import head, long_timing

    backend = LocalBackend(tmp_path / "s")
    store = open_store(backend)
    save(store, 1)
    save(store, 2)
    # step 1's commit goes (retention): its pieces stay, named by step 2, and are no save of their own
    assert store.gc(keep_last=1, grace_seconds=3600).deleted_saves
    w = store.save(3)
    w.put("model", [memoryview(FROZEN), memoryview(head(3))])  # pieces only: nothing under saves/ yet
    infos = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).list_saves()
    by_step = {i.step: i for i in infos}
    assert sorted(by_step) == [2, 3], [(i.step, i.state, i.detail) for i in infos]
    assert by_step[3].state is SaveState.IN_PROGRESS and "piece(s)" in by_step[3].detail
    assert 0 < by_step[3].bytes < len(FROZEN)  # only the head was written: the backbone is step 1's
    assert main(["ls", str(tmp_path / "s"), RUN]) == 0
    assert "in-progress" in capsys.readouterr().out
    later = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).list_saves(grace_seconds=0)
    assert {i.step: i.state for i in later}[3] is SaveState.PARTIAL
    w.put("state.json", b"{}")
    w.commit()
    assert [i.step for i in CheckpointStore.open(backend, RUN, piece_timing=long_timing()).list_saves()] == [3, 2]
