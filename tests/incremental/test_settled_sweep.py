"""What a version-3 run keeps on storage (PROTOCOL.md §9.5 step 5): once gc
read a save's commit, a piece under that save's ID that nothing marks goes at
any age, so retention after each save leaves the pieces its kept saves name
and nothing more — as version 2 leaves their components. A piece under an
uncommitted save's ID still waits out the grace period (a save in progress
may be writing it), and a replication that uploads a piece under another
save's ID does so under an intent naming it (§9.6 step 2)."""

from __future__ import annotations

import torch

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.core.intents import PieceTiming
from ckptstore.core.piece_evidence import list_pieces
from ckptstore.protocol import CommitRecord, ComponentEntry
from ckptstore.protocol.records import PieceRef, pieces_digest
from ckptstore.tiers.durable_intent import DurableIntent
from ckptstore.torch import Checkpointer
from tests.incremental.common import FROZEN, GRACE, IDENT, RUN, head, long_timing, open_store, save


def named_by_kept(store: CheckpointStore) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    for info in store.list_saves():
        if info.ref is not None:
            out |= set(info.ref.record.piece_refs())
    return out


def test_full_fine_tuning_keeps_only_what_its_kept_saves_name(backend: Backend) -> None:
    """Every tensor changes at every save; with keep_last=2 the run holds, after
    each save's retention, exactly the pieces of its two newest saves (it held
    every save of the last hour before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = open_store(backend)
    ck = Checkpointer(store, {"model": model, "optimizer": opt}, async_save=False, handle_signals=False,
                      keep_last=2)
    io = store._io  # noqa: SLF001 - the test reads the run's pieces as stored
    for step in range(6):
        model(torch.randn(4, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ck.save(step, blocking=True)
        kept = [i for i in store.list_saves() if i.ref is not None]
        assert sorted(i.step for i in kept) == list(range(max(0, step - 1), step + 1))
        assert set(list_pieces(io)) == named_by_kept(store)
    ck.close()


def test_a_killed_saves_pieces_wait_out_the_grace() -> None:
    """A save that wrote pieces and never committed (a killed writer) may still
    be in progress for all gc knows: its pieces stay until the grace period,
    while what only a deleted commit named goes at once."""
    backend = MemoryBackend("settled-killed")
    w = open_store(backend)
    save(w, 1)
    save(w, 2)
    staged = w.stage(3)
    staged.put("model", [memoryview(FROZEN), memoryview(head(3))])  # then the process dies
    ref1 = next(i for i in w.list_saves() if i.step == 1)
    gc = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).gc(keep_last=1, grace_seconds=GRACE)
    assert gc.pieces_refused is None
    assert [sid for sid, _ in gc.deleted_saves] == [ref1.save_id]
    left = list_pieces(w._io)  # noqa: SLF001
    ref2 = w.latest_complete()
    assert ref2 is not None and ref2.step == 2
    # of what save 1 wrote, only what save 2 names is left: save 1's head went at once
    assert {hd for hd in left if hd[0] == ref1.save_id} == {hd for hd in ref2.record.piece_refs()
                                                            if hd[0] == ref1.save_id}
    assert len({hd for hd in left if hd[0] == ref1.save_id}) >= 1
    assert any(h == staged.save_id for h, _ in left)  # the killed save's head is young: kept (in progress)


def test_a_replication_names_what_it_uploads_under_another_saves_id() -> None:
    """A piece of a local save that the durable tier lacks, held under an
    earlier save's ID (the local writer reused it from a save that was not
    replicated), is uploaded under that ID: the replicator's intent must name
    it before the upload, even when its standing intent covers every piece
    it skips."""
    durable = MemoryBackend("settled-durable")
    store = CheckpointStore.open(durable, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing())
    io = store._io  # noqa: SLF001
    attempt = store.attempt
    assert attempt is not None
    timing = PieceTiming(window=0.05, intent_ttl=GRACE)
    guard = DurableIntent(io, attempt.number, timing)

    def record(step: int, pieces: list[PieceRef], sid: str) -> CommitRecord:
        comp = ComponentEntry("model", sum(p.size for p in pieces), pieces_digest(pieces), tuple(pieces))
        return CommitRecord(RUN, step, attempt.number, sid, store.writer_id, store.identity_digest,
                            {"model": comp}, 0.0, version=3)

    s1, s2 = f"{1:012d}-{attempt.number:08d}-aaaaaaaaaaaa", f"{2:012d}-{attempt.number:08d}-bbbbbbbbbbbb"
    own = PieceRef(s1, "1" * 64, 10)
    guard.learn(record(1, [own], s1))  # save 1 is durable: its intent names its piece
    assert guard.armed is not None and set(guard.armed.record.pieces) == {(s1, "1" * 64)}
    older = PieceRef(f"{0:012d}-{attempt.number:08d}-cccccccccccc", "0" * 64, 10)  # never made durable
    fresh = PieceRef(s2, "2" * 64, 10)
    have = guard.protect(record(2, [own, older, fresh], s2))
    assert guard.armed is not None and (older.holder, older.digest) in set(guard.armed.record.pieces)
    assert guard.relying
    assert (older.holder, older.digest) not in have and (fresh.holder, fresh.digest) not in have


def test_a_save_kept_as_evidence_keeps_its_pieces() -> None:
    """The newest commit record is rewritten to name another save ID (THREATS
    §4.3): its real save is kept as corrupt evidence by gc, and so are its
    pieces, whatever their age — repairing the record brings the save back
    whole."""
    backend = MemoryBackend("settled-evidence")
    w = open_store(backend)
    for step in (1, 2, 3):
        save(w, step)
    ref3 = w.latest_complete()
    assert ref3 is not None and ref3.step == 3
    w.close()
    key = f"{RUN}/commits/" + next(k.rsplit("/", 1)[-1] for k in backend.list_keys(f"{RUN}/commits/")
                                   if f"-{3:012d}." in k)
    good = backend.get(key)
    other = ref3.save_id[:-1] + ("0" if ref3.save_id[-1] != "0" else "1")
    backend.put(key, [good.replace(ref3.save_id.encode(), other.encode())])
    before = {hd for hd in list_pieces(w._io) if hd[0] == ref3.save_id}  # noqa: SLF001
    assert before
    gc = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).gc(keep_last=1, grace_seconds=0)
    assert ref3.save_id in gc.kept
    assert {hd for hd in list_pieces(w._io) if hd[0] == ref3.save_id} == before  # noqa: SLF001
    backend.put(key, [good])  # the operator repairs the record
    reader = CheckpointStore.open(backend, RUN, piece_timing=long_timing())
    again = reader.latest_complete(deep=True)
    assert again is not None and again.step == 3 and reader.read(again, "model") == FROZEN + head(3)


def test_a_gc_whose_grace_is_shorter_than_the_intents_still_sweeps_what_committed_saves_held() -> None:
    """A live writer's intent lives an hour; a gc with no grace cannot judge the
    pieces of uncommitted saves by age (a save may still be writing them), but
    the pieces only a deleted commit named go at once, and it says so."""
    backend = MemoryBackend("settled-grace")
    w = open_store(backend)
    for step in (1, 2, 3):
        save(w, step)
    staged = w.stage(4)
    staged.put("model", [memoryview(FROZEN), memoryview(head(4))])  # in flight
    gc = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).gc(keep_last=1, grace_seconds=0)
    assert gc.pieces_refused is None and gc.pieces_deferred is not None and "grace" in gc.pieces_deferred
    assert gc.pieces_freed == 4  # the head and state of saves 1 and 2
    assert any(hd[0] == staged.save_id for hd in list_pieces(w._io))  # noqa: SLF001 - the save in flight keeps its own
    assert [i.step for i in w.list_saves() if i.ref is not None] == [3]
    assert not any(i.step in (1, 2) for i in w.list_saves())  # no retired save shows as "in progress"


def test_keys_under_pieces_that_are_not_pieces_are_reported_and_left_alone() -> None:
    backend = MemoryBackend("settled-junk")
    w = open_store(backend)
    save(w, 1)
    ref = w.latest_complete()
    assert ref is not None
    junk = [f"{RUN}/pieces/{ref.save_id}/.hidden", f"{RUN}/pieces/{ref.save_id}/{'a' * 63}",
            f"{RUN}/pieces/{ref.save_id}/{'A' * 64}", f"{RUN}/pieces/not-a-save-id/{'0' * 64}"]
    for k in junk:
        backend.put(k, [b"junk"])
    gc = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).gc(keep_last=1, grace_seconds=0)
    assert sorted(gc.ignored) == sorted(junk)
    assert all(backend.get(k) == b"junk" for k in junk)


def test_pieces_a_killed_writers_intent_still_names_are_no_save_in_progress() -> None:
    """A killed writer's intent names its last save's pieces until it expires,
    so gc keeps them after that save's commit was deleted: the listing does
    not take them for a save in progress (every piece of the holder is named
    by a live intent), and they go when the intent expires."""
    backend = MemoryBackend("settled-killed-intent")
    first = open_store(backend)
    save(first, 1, frozen=b"\x01" * len(FROZEN))  # no piece of it is in a later save
    first._place.pieces.settle()  # type: ignore[union-attr]  # noqa: SLF001 - its intent landed; then it dies (no close)
    again = open_store(backend)
    save(again, 2)
    save(again, 3)
    gc = again.gc(keep_last=1, grace_seconds=GRACE)
    assert gc.pieces_refused is None and {s for s, _ in gc.deleted_saves}
    rows = [(i.step, i.state.value) for i in again.list_saves()]
    assert rows == [(3, "committed")], rows
