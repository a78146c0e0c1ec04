"""The anchor on many ranks (PROTOCOL.md §9.4): a rank whose part another
process commits relies on the pieces of the commit it learned last without
waiting for its intent's window, and the coordinator checks, with its
commit, that this commit is still the newest (else waits for that rank's
intent). Two real rank processes save every two steps with a window no test
would sit through (600 s): the job finishes, and resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptstore import CheckpointStore
from tests.incremental.common import LONG
from tests.workers.dist_launch import RankResult, run_job

WORKER = str(Path(__file__).parents[1] / "workers" / "piece_rank_worker.py")
IDENT = {"data_digest": "d", "code_digest": "c", "world_size": 2}


def test_ranks_saving_in_a_row_never_wait_for_the_window(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    CheckpointStore.open(url, "run", identity=IDENT, protocol_version=3).close()
    res: list[RankResult] = run_job(2, url, "train", worker=WORKER, timeout=180, args={
        "stop": 12, "keep_last": 2, "window": 600.0, "intent_ttl": LONG})
    out: list[Any] = [r.results.get("ckpt") for r in res]
    assert all(o is not None and o["ok"] and o["start"] == 0 for o in out), \
        [(r.rank, r.returncode, r.results, r.stderr[-3000:]) for r in res]
    st = CheckpointStore.open(url, "run", mode="r")
    ref = st.latest_complete(deep=True)
    assert ref is not None and ref.step == 11
    # every save after the first reused the frozen backbone of every rank
    assert all(i.bytes_written is not None and i.bytes_referenced is not None and i.bytes_written < i.bytes_referenced
               for i in st.list_saves() if i.ref is not None)


# ------------------------------------------------------- the coordinator's check, pure
def _deadline(anchor: tuple[int, int] | None, landed: float | None = 1000.0, expires: float | None = 5000.0) -> Any:
    from ckptstore.core.piece_deadlines import PieceDeadline

    return PieceDeadline(900.0, expires, anchor=anchor, intent_landed_at=landed)


def test_a_part_anchored_on_the_coordinators_anchor_needs_no_wait() -> None:
    from ckptstore.core.intents import PieceTiming
    from ckptstore.core.piece_deadlines import check_rank_anchors

    waits: list[float] = []
    t = PieceTiming(window=600.0, intent_ttl=LONG, clock=lambda: 1001.0, sleep=waits.append)
    check_rank_anchors({1: _deadline((4, 1)), 2: _deadline(None)}, (4, 1), t, "s")
    assert waits == []


def test_a_part_anchored_on_a_commit_that_is_no_longer_the_newest_waits_for_its_intent() -> None:
    import pytest

    from ckptstore.core.intents import PieceTiming
    from ckptstore.core.piece_deadlines import check_rank_anchors
    from ckptstore.errors import SaveAbortedError

    waits: list[float] = []
    t = PieceTiming(window=600.0, intent_ttl=LONG, clock=lambda: 1001.0, sleep=waits.append)
    check_rank_anchors({1: _deadline((4, 1))}, (6, 1), t, "s")  # another commit since: the intent protects it
    assert waits == [pytest.approx(599.0)]
    check_rank_anchors({1: _deadline((4, 1))}, None, t, "s")  # the coordinator's anchor does not hold
    assert len(waits) == 2
    with pytest.raises(SaveAbortedError, match="no save intent names them"):
        check_rank_anchors({1: _deadline((4, 1), landed=None, expires=None)}, (6, 1), t, "s")
    with pytest.raises(SaveAbortedError, match="expired"):
        check_rank_anchors({1: _deadline((4, 1), expires=1100.0)}, (6, 1), t, "s")


def test_a_deadline_report_is_decoded_strictly() -> None:
    import pytest

    from ckptstore.core.piece_deadlines import PieceDeadline
    from ckptstore.errors import SaveAbortedError

    d = _deadline((4, 1))
    assert PieceDeadline.from_json(d.to_json()) == d
    for bad in ({**d.to_json(), "anchor": [4]}, {**d.to_json(), "anchor": [4, True]}, {**d.to_json(), "anchor": "4,1"},
                {**d.to_json(), "intent_landed_at": "now"}, {k: v for k, v in d.to_json().items() if k != "anchor"},
                {**d.to_json(), "extra": 1}, {**d.to_json(), "anchor": [-1, 1]}):
        with pytest.raises(SaveAbortedError, match="malformed"):
            PieceDeadline.from_json(bad)
