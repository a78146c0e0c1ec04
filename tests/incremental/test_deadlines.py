"""A coordinator's re-check of every rank's part of a version-3 save
(PROTOCOL.md §9.4 steps 1-2 across processes): the reports are parsed
strictly and a part that outlived its protection aborts the publish."""

from __future__ import annotations

import pytest

from ckptstore.core.intents import PieceTiming
from ckptstore.core.piece_deadlines import PieceDeadline, check_deadlines
from ckptstore.errors import SaveAbortedError

#: the coordinator's clock, stopped: each case is decided by the numbers, not by how fast it runs
NOW = 1_800_000_000.0
T = PieceTiming(window=2.0, intent_ttl=60.0, clock=lambda: NOW)


def test_fresh_parts_pass() -> None:
    check_deadlines({0: PieceDeadline(NOW - 1, None), 1: PieceDeadline(NOW - 57.9, NOW + 2.1)}, T, "s")


def test_a_part_that_began_too_long_ago_aborts() -> None:
    with pytest.raises(SaveAbortedError, match="rank 1's part took longer"):
        check_deadlines({0: PieceDeadline(NOW, None), 1: PieceDeadline(NOW - 58.1, None)}, T, "s")


def test_an_intent_expiring_within_the_window_aborts() -> None:
    with pytest.raises(SaveAbortedError, match="intent rank 0 relies on expired"):
        check_deadlines({0: PieceDeadline(NOW, NOW + 1.9)}, T, "s")


@pytest.mark.parametrize("bad", [None, [], {}, {"started_at": 1.0}, {"started_at": "1", "intent_expires_at": None},
                                 {"started_at": True, "intent_expires_at": None},
                                 {"started_at": 1.0, "intent_expires_at": None, "extra": 1},
                                 {"started_at": 1.0, "intent_expires_at": [2]}])
def test_malformed_reports_are_refused(bad: object) -> None:
    with pytest.raises(SaveAbortedError, match="malformed"):
        PieceDeadline.from_json(bad)


def test_round_trip() -> None:
    d = PieceDeadline(12.5, 99.0)
    assert PieceDeadline.from_json(d.to_json()) == d
