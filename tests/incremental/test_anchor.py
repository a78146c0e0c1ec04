"""The anchor (PROTOCOL.md §9.4): a save may rely on the pieces of the newest
commit its own writer published without waiting for its intent to be a window
old, because every gc keeps the newest commit that is not superseded and marks
what it names; anything else a save relies on still waits for its intent.

The waits are seen through an injected ``PieceTiming.sleep`` that records and
returns at once, so a save that would wait is counted, never timed; a gc
between a save's checks and its commit is run at a fault point (the commit
record's create), never by a wall-clock window."""

from __future__ import annotations

from collections.abc import Callable

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.core.intents import PieceTiming
from ckptstore.protocol.layout import intents_prefix, pieces_prefix
from tests.incremental.common import FROZEN, IDENT, LONG, RUN, Clock, head, save

#: a window no test would sit through: a save that waits for it is counted by ``Waits``, never slept
WINDOW = 600.0


class Waits:
    """An injected ``PieceTiming.sleep``: records each wait for the window and returns at once."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.seen.append(seconds)

    def take(self) -> list[float]:
        out, self.seen = self.seen, []
        return out


def timing(waits: Waits, clock: Clock | None = None) -> PieceTiming:
    return PieceTiming(window=WINDOW, intent_ttl=LONG, clock=clock or Clock(), sleep=waits)


def writer(backend: Backend, waits: Waits, **kw: object) -> CheckpointStore:
    return CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=timing(waits),
                                **kw)  # type: ignore[arg-type]


def reused(store: CheckpointStore, step: int) -> int:
    """Bytes save ``step`` named but did not write (pieces of earlier saves)."""
    info = next(i for i in store.list_saves() if i.step == step)
    assert info.bytes_referenced is not None and info.bytes_written is not None
    return info.bytes_referenced - info.bytes_written


def restores(backend: Backend, step: int, model: bytes) -> None:
    reader = CheckpointStore.open(backend, RUN, piece_timing=PieceTiming(window=0.2, intent_ttl=LONG))
    ref = reader.latest_complete(deep=True)
    assert ref is not None and ref.step == step
    buf = bytearray(len(model))
    reader.read_into(ref, "model", buf)
    assert bytes(buf) == model


def test_saves_in_a_row_rely_on_their_own_last_commit_without_the_window(backend: Backend) -> None:
    waits = Waits()
    w = writer(backend, waits)
    model = b""
    for step in range(1, 5):
        model = save(w, step)
    assert waits.take() == []  # no save waited for its intent ...
    for step in range(2, 5):
        assert reused(w, step) >= len(FROZEN)  # ... and every save after the first skipped the frozen part
    restores(backend, 4, model)


def test_the_first_save_after_a_restart_waits_for_its_intent() -> None:
    """The resume point was judged by selection, which may have skipped newer
    commits that a gc still counts as complete (a gc may then delete it): it
    is no anchor. The save after it relies on the restarted writer's own commit."""
    backend = MemoryBackend("anchor-restart")
    waits = Waits()
    first = writer(backend, waits)
    save(first, 1)
    first.close()
    waits.take()
    again = writer(backend, waits)
    assert again.resumed_from is not None and again.resumed_from.step == 1
    save(again, 2)
    assert len(waits.take()) == 1 and reused(again, 2) >= len(FROZEN)
    model = save(again, 3)
    assert waits.take() == []
    restores(backend, 3, model)


def test_a_save_begun_before_another_commit_of_its_writer_waits() -> None:
    """A commit of the same writer between a save's begin and its checks may
    let a gc delete the commit that save relies on: it waits for its intent."""
    backend = MemoryBackend("anchor-overlap")
    waits = Waits()
    w = writer(backend, waits)
    save(w, 1)
    early = w.stage(3)  # begun under the anchor of save 1
    early.put("model", [memoryview(FROZEN), memoryview(head(3))])
    early.put("state.json", b'{"step": 3}')
    save(w, 2)  # relies on save 1, the newest commit: no wait
    assert waits.take() == []
    w.publish(3, early.save_id, early.components)  # save 2 committed since it began
    assert len(waits.take()) == 1
    restores(backend, 3, FROZEN + head(3))


def test_a_commit_below_the_resume_point_is_no_anchor() -> None:
    """After resuming from step 5, a save of step 3 is not the newest commit: a
    gc keeping one save keeps step 5 and may delete it, so the save after it
    waits. (Step 5 saved again by the new attempt would be newer than the
    first attempt's step 5, by gc's order, and an anchor.)"""
    backend = MemoryBackend("anchor-floor")
    waits = Waits()
    first = writer(backend, waits)
    save(first, 5)
    first.close()
    again = writer(backend, waits)
    save(again, 3)
    waits.take()
    save(again, 6)
    assert len(waits.take()) == 1


def test_a_commit_below_an_earlier_one_of_the_same_writer_is_no_anchor() -> None:
    backend = MemoryBackend("anchor-order")
    waits = Waits()
    w = writer(backend, waits)
    save(w, 4)
    save(w, 2)  # relies on save 4 (the anchor): no wait
    assert waits.take() == []
    save(w, 7)  # save 2 is not the newest commit: a gc may delete it, so this save waits
    assert len(waits.take()) == 1


class GcAtCommit(FaultyBackend):
    """Runs ``hook`` once, just before the commit record of step ``step`` is created."""

    hook: Callable[[], None] | None = None
    step: int = 0

    def create(self, key: str, data: bytes) -> bool:
        if self.hook is not None and "/commits/" in key and f"-{self.step:012d}." in key:
            hook, self.hook = self.hook, None
            hook()
        return super().create(key, data)


def test_a_gc_between_an_anchored_saves_checks_and_its_commit_keeps_what_it_relies_on(backend: Backend) -> None:
    """A gc that keeps one save runs after save 2 checked its pieces and
    before its commit exists, and sees no intent (as a gc round that listed
    the intents before the writer's landed): save 1 is still the newest
    commit, so it is kept and every piece it names is marked although all of
    them are old by gc's clock; save 2's own pieces are young. Save 2 commits
    a whole save, and the next gc frees only what save 1 alone named."""
    import time

    waits = Waits()
    fb = GcAtCommit(backend)
    w = writer(fb, waits)
    save(w, 1)
    ref1 = w.latest_complete()
    assert ref1 is not None
    time.sleep(1.1)  # a lower bound only: save 2's pieces are listed at least a second after save 1's
    times = [o.mtime for o in backend.list(pieces_prefix(RUN) + f"{ref1.save_id}/")]
    gc_clock = Clock(fixed=max(times) + LONG + 0.5)  # save 1's pieces are old, save 2's young
    reports = []

    def gc() -> None:
        reports.append(CheckpointStore.open(backend, RUN, piece_timing=PieceTiming(
            window=0.2, intent_ttl=LONG, clock=gc_clock)).gc(keep_last=1, grace_seconds=LONG))

    def intents_unseen_then_gc() -> None:
        for key in backend.list_keys(intents_prefix(RUN)):
            backend.delete(key)
        gc()

    fb.hook, fb.step = intents_unseen_then_gc, 2
    model = save(w, 2)
    assert waits.take() == [] and fb.hook is None and len(reports) == 1
    first = reports[0]
    assert first.pieces_refused is None and first.deleted_saves == [] and first.pieces_freed == 0
    assert first.pieces_marked >= 3  # save 1's pieces, by its commit alone
    restores(backend, 2, model)
    gc()
    assert reports[1].pieces_refused is None and [s for s, _ in reports[1].deleted_saves] == [ref1.save_id]
    assert reports[1].pieces_freed >= 1  # what only save 1 named (its head)
    restores(backend, 2, model)
