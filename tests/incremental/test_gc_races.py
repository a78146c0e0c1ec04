"""gc of shared pieces racing saves (PROTOCOL.md §9.3-9.5), on every backend:
a save relying on another save's pieces survives that save's deletion and a
gc in the middle of its upload; gc first and the save second; gc crashing at
every operation; a killed writer's intent expires and its pieces go.

Intents expire and pieces age by injected clocks (``Clock``), never by
sleeping past a short lifetime: every intent lives an hour, so no save of
a loaded machine runs out of protection."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import Crashed, FaultyBackend
from ckptstore.core.collector import GcReport
from tests.incremental.common import (
    FROZEN,
    GRACE,
    IDENT,
    LONG,
    RUN,
    Clock,
    age_past_grace,
    gc_clock_past,
    head,
    long_timing,
    open_store,
    save,
    wait_for_intent,
)

V3 = P.layout_of(3)


def delete_commit(backend: Backend, step: int) -> None:
    """An operator (or another gc) removes save ``step``'s commit record."""
    backend.delete(V3.commit_key(RUN, step, 1))


def assert_restores(backend: Backend, step: int, model: bytes) -> None:
    """The newest save is ``step``, verifies deep and reads back bit for bit."""
    reader = CheckpointStore.open(backend, RUN, piece_timing=long_timing())
    ref = reader.latest_complete(deep=True)
    assert ref is not None and ref.step == step
    buf = bytearray(len(model))
    reader.read_into(ref, "model", buf)
    assert bytes(buf) == model


def writer_and_gc(backend: Backend) -> tuple[CheckpointStore, Callable[[], GcReport]]:
    """A writer with a long intent lifetime that has made save 1, and a gc
    (grace LONG) whose clock says save 1's pieces are just old enough to sweep
    while the next save's own pieces are young. The writer's clock is moved
    past half its intent's life, so save 2 renews its intent when it begins:
    the race is decided by these clocks and the order of the calls, not by how
    fast a loaded machine runs (nothing here expires while the test runs)."""
    wclock = Clock()
    writer = CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing(wclock))
    save(writer, 1)
    ref = writer.latest_complete()
    assert ref is not None
    time.sleep(1.1)  # a lower bound only: save 2's pieces are listed at least a second after save 1's
    wclock.offset = LONG / 2 + 1
    gclock = gc_clock_past(backend, ref.save_id)
    gc: Callable[[], GcReport] = lambda: CheckpointStore.open(  # noqa: E731
        backend, RUN, piece_timing=long_timing(gclock)).gc(keep_last=1, grace_seconds=LONG)
    return writer, gc


def test_gc_while_a_save_reusing_pieces_uploads(backend: Backend) -> None:
    writer, gc = writer_and_gc(backend)
    with writer.save(2) as w:  # B reuses A's pieces
        w.put("model", [memoryview(FROZEN), memoryview(head(2))])
        delete_commit(backend, 1)  # A goes ...
        report = gc()
        # ... but B's intent marks what B relies on (every piece of A, old by gc's clock, is kept)
        assert report.pieces_refused is None and report.pieces_marked >= 4 and report.pieces_freed == 0
        w.put("state.json", b'{"step": 2}')
    assert_restores(backend, 2, FROZEN + head(2))
    again = gc()  # the writer's intent now names B's pieces: what only A named is old by gc's clock and goes
    assert again.pieces_refused is None and again.pieces_freed == 2
    assert_restores(backend, 2, FROZEN + head(2))


def gc_at(backend: Backend, clock: Clock) -> GcReport:
    return CheckpointStore.open(backend, RUN, piece_timing=long_timing(clock)).gc(keep_last=1, grace_seconds=GRACE)


def test_gc_first_then_the_save(backend: Backend) -> None:
    clock = Clock()  # the writer's and gc's
    writer = open_store(backend, clock)
    save(writer, 1)
    wait_for_intent(backend)  # dated before time passes
    delete_commit(backend, 1)
    age_past_grace(clock)  # the writer's intent expires, A's pieces are old
    report = gc_at(backend, clock)
    assert report.pieces_freed > 0 and report.piece_bytes_freed >= len(FROZEN) and report.intents_expired
    model = save(writer, 2)  # the writer still thinks it holds A's pieces: it must find out and write them again
    assert_restores(backend, 2, model)


def test_a_killed_writers_intent_expires(backend: Backend) -> None:
    writer, gc = writer_and_gc(backend)
    staged = writer.stage(2)  # a fresh intent naming save 1's pieces (the writer's clock is past half the old one's life)
    staged.put("model", [memoryview(FROZEN), memoryview(head(2))])  # then the process dies: no publish, no close
    delete_commit(backend, 1)
    # within the intent's lifetime: save 1's pieces are old and marked only by the killed writer's
    # intent; the killed save's own new piece is younger than the grace
    first = gc()
    assert first.pieces_freed == 0 and not first.intents_expired and first.pieces_marked > 0
    # the intent expires (its life is LONG from the writer's clock, at most LONG / 2 + 1 ahead of the real one),
    # and every piece is older than the grace by then
    second = gc_at(backend, Clock(offset=2 * LONG + 2))
    assert second.intents_expired and second.pieces_freed > 0 and second.piece_bytes_freed >= len(FROZEN)
    assert backend.list_keys(P.layout.intents_prefix(RUN)) == []
    assert backend.list_keys(P.layout.pieces_prefix(RUN)) == []


def test_gc_crashing_at_every_operation(backend: Backend) -> None:
    writer = open_store(backend)
    for step in (1, 2, 3):
        model = save(writer, step)
    writer.close()  # its intent goes; the commits mark their pieces
    clock = Clock()
    age_past_grace(clock)  # every piece is old to a gc at this clock
    n = 1
    while True:
        faulty = FaultyBackend(backend).crash_at(n)
        try:
            gc_at(faulty, clock)
        except Crashed:
            assert_restores(backend, 3, model)  # whatever gc did up to the crash, the kept save is whole
            n += 1
            continue
        break
    assert n > 5
    final = CheckpointStore.open(backend, RUN, piece_timing=long_timing(clock))
    final.gc(keep_last=1, grace_seconds=GRACE)
    ref = final.latest_complete()
    assert ref is not None
    named = {V3.commit_key(RUN, 3, 1)} | {P.layout.piece_key(RUN, h, d) for h, d in ref.record.piece_refs()}
    left = set(backend.list_keys(P.layout.pieces_prefix(RUN))) | set(backend.list_keys(P.commits_prefix(RUN)))
    assert left == named  # everything else was collected, nothing named was
    assert_restores(backend, 3, model)


@pytest.mark.parametrize("where", ["after-first-put", "before-publish"])
def test_gc_at_each_point_of_a_save(backend: Backend, where: str) -> None:
    writer, gc = writer_and_gc(backend)
    reports: list[GcReport] = []
    with writer.save(2) as w:
        if where == "after-first-put":
            w.put("model", [memoryview(FROZEN), memoryview(head(2))])
            delete_commit(backend, 1)
            reports.append(gc())
            w.put("state.json", b'{"step": 2}')
        else:
            w.put("state.json", b'{"step": 2}')
            w.put("model", [memoryview(FROZEN), memoryview(head(2))])
            delete_commit(backend, 1)
            reports.append(gc())
    # the writer's intent kept every old piece of save 1 while save 2 was in flight
    assert reports[0].pieces_refused is None and reports[0].pieces_freed == 0 and reports[0].pieces_marked >= 4
    assert_restores(backend, 2, FROZEN + head(2))
    after = gc()  # and the clocks do make them sweepable: what only save 1 named goes now
    assert after.pieces_refused is None and after.pieces_freed == 2
    assert_restores(backend, 2, FROZEN + head(2))
