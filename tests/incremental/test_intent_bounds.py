"""Planted save intents against gc's piece sweep (issue 30 class 6, PROTOCOL.md
§9.5 step 4, THREATS.md §4.12): huge, many, future-dated, inverted and junk
intents. gc reads a bounded number of intents and bytes (each changed intent
once per sweep), stops after a few rounds that delete nothing, refuses an
implausibly dated intent, and says why whenever it did not sweep; the saves
stay restorable bit for bit and nothing outside the run changes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.cli import main
from ckptstore.core.collector import MAX_IDLE_ROUNDS, GcReport
from ckptstore.core.intents import MAX_INTENT_BYTES, PieceTiming
from ckptstore.protocol.records import IntentRecord
from tests.incremental.common import IDENT, LONG, RUN, Clock, gc_clock_past, long_timing, save

HOLDER = "000000000009-00000001-0123456789ab"


def three_saves(backend: Backend) -> tuple[bytes, Clock]:
    """Saves 1-3 by a closed writer (no intent of its own left), and a gc clock at which
    what saves 1 and 2 alone named is old enough to sweep."""
    w = CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing())
    for step in (1, 2, 3):
        model = save(w, step)
    ref = w.latest_complete()
    assert ref is not None
    w.close()
    return model, gc_clock_past(backend, ref.save_id)


def intent(at: float, n_pieces: int = 1, life: float = LONG - 1, attempt: int = 1) -> bytes:
    names = tuple(sorted((HOLDER, f"{i:064x}") for i in range(n_pieces)))
    return IntentRecord(RUN, attempt, at, at + life, names, version=3).encode()


def plant(backend: Backend, data: bytes, attempt: int = 1, n: int = 0) -> str:
    key = P.layout.intents_prefix(RUN) + f"{attempt:08d}-{n:012x}.json"
    backend.put(key, [data])
    return key


def gc(backend: Backend, clock: Clock, window: float = 60.0) -> GcReport:
    """A gc whose deletes have ``window / 2`` after each listing of the intents (long by default: no round
    runs late on a loaded machine; 0: every round runs late)."""
    t = PieceTiming(window=window, intent_ttl=LONG, clock=clock)
    return CheckpointStore.open(backend, RUN, piece_timing=t).gc(keep_last=1, grace_seconds=LONG)


def restores(backend: Backend, model: bytes) -> None:
    r = CheckpointStore.open(backend, RUN, mode="r")
    ref = r.latest_complete(deep=True)
    assert ref is not None and ref.step == 3
    buf = bytearray(len(model))
    r.read_into(ref, "model", buf)
    assert bytes(buf) == model


def pieces_of(backend: Backend) -> set[str]:
    return set(backend.list_keys(P.layout.pieces_prefix(RUN)))


def test_two_huge_intents_are_read_once_and_the_sweep_finishes(backend: Backend) -> None:
    model, clock = three_saves(backend)
    at = clock() - 10
    huge = intent(at, 20_000)  # ~2 MiB: far more than a writer's intent names (each read once is the point)
    for i in range(2):
        plant(backend, huge, n=i)
    report = gc(backend, clock, window=0.0)  # every round's deletes are late: the intents are listed each round
    assert report.pieces_refused is not None and "rounds in a row" in report.pieces_refused
    assert report.sweep_rounds == MAX_IDLE_ROUNDS
    assert report.intent_bytes_read == 2 * len(huge)  # each read once, not once a round
    done = gc(backend, clock)
    assert done.pieces_refused is None and done.pieces_freed == 4 and done.sweep_rounds == 1
    restores(backend, model)


def test_intents_past_the_byte_bound_refuse_the_sweep_before_any_is_read(backend: Backend) -> None:
    model, clock = three_saves(backend)
    junk = b"x" * (15 << 20)
    for i in range(MAX_INTENT_BYTES // len(junk) + 1):
        plant(backend, junk, n=i)
    before = pieces_of(backend)
    report = gc(backend, clock)
    assert report.pieces_refused is not None and "more than gc reads" in report.pieces_refused
    assert "remove the ones no live writer made" in report.pieces_refused
    assert report.intent_bytes_read == 0 and report.pieces_freed == 0
    assert pieces_of(backend) == before
    restores(backend, model)


def test_many_small_intents_are_read_once_each(backend: Backend) -> None:
    model, clock = three_saves(backend)
    at = clock() - 10
    small = intent(at, 1)
    for i in range(300):
        plant(backend, small, n=i)
    report = gc(backend, clock)
    assert report.pieces_refused is None and report.pieces_freed == 4
    assert report.intent_bytes_read == 300 * len(small) and report.sweep_rounds == 1
    restores(backend, model)


@pytest.mark.parametrize("shape", ["future", "inverted", "junk"])
def test_an_implausible_or_unreadable_intent_refuses_the_sweep_and_says_why(backend: Backend, shape: str) -> None:
    model, clock = three_saves(backend)
    data = {"future": intent(clock() + 50 * 365 * 86400),  # dated 50 years ahead
            "inverted": intent(clock() - 10, life=-5),
            "junk": b'{"kind": "intent"'}[shape]
    key = plant(backend, data)
    before = pieces_of(backend)
    report = gc(backend, clock)
    assert report.pieces_refused is not None and key in report.pieces_refused
    assert {"future": "after gc's clock", "inverted": "not a time after created_at",
            "junk": "no piece is swept while an intent cannot be read"}[shape] in report.pieces_refused
    assert report.pieces_freed == 0 and pieces_of(backend) == before and backend.list_keys(key) == [key]
    restores(backend, model)
    backend.delete(key)  # the operator removes it: the next gc sweeps
    assert gc(backend, clock).pieces_freed == 4


def test_an_intent_under_a_foreign_name_is_neither_read_nor_deleted(backend: Backend) -> None:
    model, clock = three_saves(backend)
    foreign = P.layout.intents_prefix(RUN) + "not-an-intent.json"
    backend.put(foreign, [b"junk"])
    report = gc(backend, clock)
    assert report.pieces_refused is None and report.pieces_freed == 4 and report.intent_bytes_read == 0
    assert backend.list_keys(foreign) == [foreign]
    restores(backend, model)


def test_the_cli_reports_why_no_piece_was_swept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backend = LocalBackend(tmp_path / "s")
    model, _ = three_saves(backend)
    plant(backend, intent(time.time() + 50 * 365 * 86400))
    assert main(["gc", str(tmp_path / "s"), RUN, "--keep-last", "1", "--grace", str(LONG), "--apply", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "after gc's clock" in rep["pieces"]["refused"] and rep["pieces"]["freed"] == 0
    assert main(["gc", str(tmp_path / "s"), RUN, "--keep-last", "1", "--grace", str(LONG), "--apply"]) == 0
    out = capsys.readouterr().out
    assert "no piece swept:" in out and "fix the writer's clock" in out
    restores(backend, model)
