"""A coordinator's re-check of every rank's part of a version-3 save
(PROTOCOL.md §9.4 steps 1-2 across processes): the reports are parsed
strictly and a part that outlived its protection aborts the publish."""

from __future__ import annotations

import time

import pytest

from ckptstore.core.pieces import PieceDeadline, PieceTiming, check_deadlines
from ckptstore.errors import SaveAbortedError

T = PieceTiming(window=2.0, intent_ttl=60.0)


def test_fresh_parts_pass() -> None:
    now = time.time()
    check_deadlines({0: PieceDeadline(now - 1, None), 1: PieceDeadline(now - 5, now + 30)}, T, "s")


def test_a_part_that_began_too_long_ago_aborts() -> None:
    with pytest.raises(SaveAbortedError, match="rank 1's part took longer"):
        check_deadlines({0: PieceDeadline(time.time(), None), 1: PieceDeadline(time.time() - 59, None)}, T, "s")


def test_an_intent_expiring_within_the_window_aborts() -> None:
    with pytest.raises(SaveAbortedError, match="intent rank 0 relies on expired"):
        check_deadlines({0: PieceDeadline(time.time(), time.time() + 1.5)}, T, "s")


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
