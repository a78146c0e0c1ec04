"""Protocol tests: every invariant of protocol_spec/PROTOCOL.md, on every backend."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from ckptstore import (
    CheckpointStore,
    CommitConflictError,
    CorruptionError,
    IdentityMismatchError,
    InvalidInputError,
    NotFoundError,
    OpenOptions,
    SaveAbortedError,
    SaveState,
    SkipReason,
    SupersededError,
)
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from tests.helpers import IDENT, blob, open_reader, open_writer, save, settle_background_writes

# these tests plant into version 2's layout: whole components under saves/ (version 3's planted pieces:
# tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)


@pytest.fixture
def open_store(backend_factory: Callable[[], Backend]):  # type: ignore[no-untyped-def]
    def _open(run: str = "run", identity=IDENT, **kw):  # type: ignore[no-untyped-def]
        return open_writer(backend_factory(), run, identity, **kw)

    return _open


def reader(backend_factory: Callable[[], Backend], run: str = "run") -> CheckpointStore:
    return open_reader(backend_factory(), run)


def component_key(ref, name: str) -> str:  # type: ignore[no-untyped-def]
    return P.component_key(ref.run_id, ref.save_id, name)


# --------------------------------------------------------------------- basics


def test_save_select_read_roundtrip(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    assert st.latest_complete() is None
    ref = save(st, 10)
    got = reader(backend_factory).latest_complete(deep=True)
    assert got is not None and got.step == 10 and got.save_id == ref.save_id
    assert got.manifest_digest == ref.manifest_digest
    assert reader(backend_factory).read(got, "model") == blob(10, "model")
    assert b"".join(reader(backend_factory).iter_read(got, "optim", chunk=1000)) == blob(10, "optim")


def test_data_forms_file_and_iterable(open_store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    f = tmp_path / "src.bin"
    f.write_bytes(b"F" * 10_000)
    with st.save(1) as s:
        with open(f, "rb") as fh:
            s.put("from_file", fh)
        s.put("from_iter", [b"ab", bytearray(b"cd"), memoryview(b"ef")])
        s.put("empty", b"")
    ref = st.latest_complete(deep=True)
    assert st.read(ref, "from_file") == b"F" * 10_000
    assert st.read(ref, "from_iter") == b"abcdef"
    assert st.read(ref, "empty") == b""
    assert ref.components["from_iter"].size == 6


def test_newest_wins_and_resume_point(open_store) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    for step in (1, 2, 3):
        save(st, step)
    st2 = open_store()
    assert st2.resumed_from is not None and st2.resumed_from.step == 3
    assert st2.attempt.number == 2 and st2.attempt.resumed_from == 3


def test_read_only_open_registers_nothing(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    writer = open_store()
    save(writer, 1)
    writer.close()  # version 3: the writer's intent is written in the background after its commit
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = backend_factory().list("run/")
    r = reader(backend_factory)
    r.latest_complete()
    r.list_saves()
    assert backend_factory().list("run/") == before
    with pytest.raises(InvalidInputError):
        r.save(2)


def test_read_only_open_of_missing_run(backend_factory) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NotFoundError, match="does not exist"):
        reader(backend_factory, "ghost")


# ------------------------------------------------------------ invariant 1


def test_interrupted_save_is_never_selected(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    good = save(st, 240)
    names = ["a", "b", "c", "d"]
    for k in range(len(names)):
        with pytest.raises(RuntimeError):
            with st.save(280 + k, expect=names) as s:
                for n in names[:k]:
                    s.put(n, blob(280, n))
                raise RuntimeError("process dies here")
        sel = reader(backend_factory).latest_complete(explain=True)
        assert sel.latest is not None and sel.latest.save_id == good.save_id


def test_killed_writer_leftovers_are_skipped_with_reason(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)  # version 3's "piece(s) written": tests/incremental/test_uncommitted.py
    good = save(st, 240)
    # simulate a writer killed after 2 of 3 components: bytes on storage, no commit
    w = st.save(280, expect=["a", "b", "c"])
    w.put("a", blob(280, "a"))
    w.put("b", blob(280, "b"))
    sel = reader(backend_factory).latest_complete(explain=True)
    assert sel.latest.save_id == good.save_id
    assert [(s.step, s.reason) for s in sel.skipped] == [(280, SkipReason.NO_COMMIT)]
    assert "2 component(s)" in sel.skipped[0].detail
    states = {i.save_id: i.state for i in reader(backend_factory).list_saves()}
    assert states[w.save_id] is SaveState.IN_PROGRESS
    assert states[good.save_id] is SaveState.COMMITTED


def test_expected_component_missing_refuses_commit(open_store) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    with pytest.raises(SaveAbortedError, match="optim"):
        with st.save(5, expect=["model", "optim"]) as s:
            s.put("model", b"m")
    assert st.latest_complete() is None


def test_empty_save_refused(open_store) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    with pytest.raises(SaveAbortedError):
        with st.save(5):
            pass
    assert st.latest_complete() is None


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_damaged_newest_falls_back_with_reason(open_store, backend_factory, damage) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)
    prev = save(st, 1)
    newest = save(st, 2)
    b = backend_factory()
    key = component_key(newest, "optim")
    data = blob(2, "optim")
    if damage == "truncate":
        b.put(key, [data[:-7]])
        expected = SkipReason.SIZE_MISMATCH
    elif damage == "delete":
        b.delete(key)
        expected = SkipReason.MISSING_COMPONENT
    else:
        flipped = bytearray(data)
        flipped[1234] ^= 0x01
        b.put(key, [bytes(flipped)])
        expected = SkipReason.HASH_MISMATCH
    r = reader(backend_factory)
    if damage == "flip":
        # the cheap check cannot see a flipped bit; the deep one must
        assert r.latest_complete().save_id == newest.save_id
        with pytest.raises(CorruptionError):
            r.read(newest, "optim")
        with pytest.raises(CorruptionError):
            list(r.iter_read(newest, "optim", chunk=500))
        assert not r.verify(newest, deep=True).ok
    sel = r.latest_complete(deep=True, explain=True)
    assert sel.latest is not None and sel.latest.save_id == prev.save_id
    assert len(sel.skipped) == 1
    assert sel.skipped[0].reason is expected and sel.skipped[0].step == 2
    assert "optim" in sel.skipped[0].detail


def test_streaming_read_withholds_last_chunk_on_corruption(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)
    ref = save(st, 1, names=("m",), size=4000)
    bad = bytearray(blob(1, "m", 4000))
    bad[-1] ^= 0xFF
    backend_factory().put(component_key(ref, "m"), [bytes(bad)])
    got = []
    with pytest.raises(CorruptionError):
        for c in st.iter_read(ref, "m", chunk=1000):
            got.append(c)
    assert sum(map(len, got)) < 4000  # the final chunk was never handed out


def test_corrupt_commit_record_is_skipped(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    prev = save(st, 1)
    save(st, 2)
    backend_factory().put(P.LATEST_LAYOUT.commit_key("run", 2, 1), [b"{not json"])
    sel = reader(backend_factory).latest_complete(explain=True)
    assert sel.latest.save_id == prev.save_id
    assert sel.skipped[0].reason is SkipReason.UNREADABLE_RECORD


def test_newer_protocol_version_is_not_selected_nor_deleted(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    prev = save(st, 1)
    b = backend_factory()
    future = {"protocol_version": P.PROTOCOL_VERSION + 1, "kind": "commit", "step": 9}
    b.create(P.LATEST_LAYOUT.commit_key("run", 9, 1), P.canonical_json(future))
    sel = reader(backend_factory).latest_complete(explain=True)
    assert sel.latest.save_id == prev.save_id
    assert sel.skipped[0].reason is SkipReason.UNSUPPORTED_VERSION
    st.gc(keep_last=1, grace_seconds=0)
    assert b.exists(P.LATEST_LAYOUT.commit_key("run", 9, 1))


# ------------------------------------------------------------ invariant 2


def test_threads_racing_one_step_in_one_attempt(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    n = 8
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def go(i: int) -> None:
        w = st.save(7)
        w.put("model", f"writer {i}".encode())
        barrier.wait()
        try:
            results[i] = w.commit()
        except CommitConflictError as exc:
            results[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    winners = [r for r in results if not isinstance(r, Exception)]
    assert len(winners) == 1, results
    assert all(isinstance(r, CommitConflictError) for r in results if r is not winners[0])
    latest = reader(backend_factory).latest_complete(deep=True)
    assert latest.save_id == winners[0].save_id
    # the losers' components were cleaned up
    saves = {i.save_id for i in reader(backend_factory).list_saves()}
    assert saves == {latest.save_id}


def test_second_commit_of_same_step_in_attempt_refused(open_store) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    save(st, 3)
    with pytest.raises(CommitConflictError, match="already committed"):
        save(st, 3)


# ------------------------------------------------------------ invariant 4


def test_gc_keeps_newest_complete_and_in_flight(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    refs = [save(st, s) for s in (1, 2, 3, 4)]
    inflight = st.save(5)
    inflight.put("model", b"still writing")
    rep = st.gc(keep_last=1, grace_seconds=3600)
    assert set(rep.kept) >= {refs[-1].save_id, inflight.save_id}
    r = reader(backend_factory)
    assert r.latest_complete(deep=True).save_id == refs[-1].save_id
    left = {i.save_id: i.state for i in r.list_saves()}
    assert left == {refs[-1].save_id: SaveState.COMMITTED, inflight.save_id: SaveState.IN_PROGRESS}
    inflight.put("optim", b"done")
    ref5 = inflight.commit()
    assert r.latest_complete(deep=True).save_id == ref5.save_id


def test_gc_dry_run_deletes_nothing_and_grace_zero_collects_partials(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    # version 2: a grace of 0 collects the in-flight save's files too; on version 3 its pieces wait while the
    # live writer's intent outlives the grace (tests/incremental/test_settled_sweep.py, pieces_deferred)
    st = open_store(options=V2)
    save(st, 1)
    save(st, 2)
    w = st.save(3)
    w.put("model", b"x")
    b = backend_factory()
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = b.list("run/")
    rep = st.gc(keep_last=1, grace_seconds=0, dry_run=True)
    assert b.list("run/") == before
    assert len(rep.deleted_saves) == 2
    st.gc(keep_last=1, grace_seconds=0)
    left = {i.save_id: i.state for i in reader(backend_factory).list_saves()}
    assert list(left.values()) == [SaveState.COMMITTED]
    with pytest.raises(InvalidInputError):
        st.gc(keep_last=0)


def test_gc_never_removes_last_good_when_newer_is_corrupt(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)
    good = save(st, 1)
    bad = save(st, 2)
    backend_factory().delete(component_key(bad, "model"))
    st.gc(keep_last=1, grace_seconds=0)
    r = reader(backend_factory)
    assert r.latest_complete(deep=True).save_id == good.save_id
    states = {i.save_id: i.state for i in r.list_saves()}
    assert states[bad.save_id] is SaveState.CORRUPT  # kept as evidence


# ------------------------------------------------------------ invariant 5


def test_identity_mismatch_lists_every_field(open_store) -> None:  # type: ignore[no-untyped-def]
    save(open_store(), 1)
    changed = {**IDENT, "data_digest": "data-48", "feature_contract": "receipt-v5", "tokenizer": "t1"}
    with pytest.raises(IdentityMismatchError) as ei:
        open_store(identity=changed)
    assert ei.value.fields == ["data_digest", "feature_contract", "tokenizer"]
    assert "receipt-v5" in str(ei.value) and "new run" in str(ei.value)
    # a changed world size is refused too
    with pytest.raises(IdentityMismatchError) as ei:
        open_store(identity={**IDENT, "world_size": 8})
    assert ei.value.fields == ["world_size"]


def test_identity_mismatch_writes_nothing(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    writer = open_store()
    save(writer, 1)
    writer.close()  # version 3: the writer's intent is written in the background after its commit
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = backend_factory().list("run/")
    with pytest.raises(IdentityMismatchError):
        open_store(identity={**IDENT, "code_digest": "other"})
    assert backend_factory().list("run/") == before


def test_reader_with_wrong_identity_refused(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    save(open_store(), 1)
    with pytest.raises(IdentityMismatchError):
        CheckpointStore.open(backend_factory(), "run", identity={**IDENT, "world_size": 2}, mode="r")


# ------------------------------------------------------------ invariant 6


def test_zombie_writer_is_fenced(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    old = open_store()
    save(old, 240)
    zombie_save = old.save(280)
    zombie_save.put("model", b"z")
    new = open_store()  # a replacement process resumes from 240
    assert new.resumed_from.step == 240
    with pytest.raises(SupersededError) as ei:
        zombie_save.commit()
    assert not ei.value.committed
    with pytest.raises(SupersededError):
        save(old, 300)
    ref = save(new, 280)
    assert reader(backend_factory).latest_complete().save_id == ref.save_id


def test_zombie_commit_that_slipped_through_is_superseded(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    old = open_store()
    save(old, 240)
    new = open_store()
    # bypass the writer's pre-commit check: write attempt 1's commit of 280 directly
    w = old.save(280)
    w.put("model", b"z")
    rec = P.CommitRecord("run", 280, 1, w.save_id, old.writer_id, old.identity_digest, w.components, 0.0)
    backend_factory().create(P.LATEST_LAYOUT.commit_key("run", 280, 1), rec.encode())
    sel = reader(backend_factory).latest_complete(explain=True)
    assert sel.latest.step == 240
    assert sel.skipped[0].reason is SkipReason.SUPERSEDED and "attempt 2" in sel.skipped[0].detail
    ref = save(new, 280)
    r = reader(backend_factory)
    assert r.latest_complete().save_id == ref.save_id
    states = {(i.step, i.attempt): i.state for i in r.list_saves()}
    assert states[(280, 1)] is SaveState.SUPERSEDED and states[(280, 2)] is SaveState.COMMITTED


def test_attempts_racing_on_one_step(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    base = open_store()
    save(base, 10)
    writers = [open_store() for _ in range(5)]  # attempts 2..6, all resume from 10
    assert [w.attempt.number for w in writers] == [2, 3, 4, 5, 6]
    barrier = threading.Barrier(len(writers))
    outcomes: list[object] = [None] * len(writers)

    def go(i: int) -> None:
        s = writers[i].save(20)
        s.put("model", f"w{i}".encode())
        barrier.wait()
        try:
            outcomes[i] = s.commit()
        except SupersededError as exc:
            outcomes[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(writers))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not isinstance(outcomes[-1], Exception)
    assert all(isinstance(o, SupersededError) for o in outcomes[:-1])
    r = reader(backend_factory)
    latest = r.latest_complete()
    assert latest.step == 20 and latest.attempt == 6
    selectable = [i for i in r.list_saves() if i.step == 20 and i.state is SaveState.COMMITTED]
    assert len(selectable) == 1


def test_vanished_component_then_recommit_same_step(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)
    save(st, 240)
    bad = save(st, 280)
    backend_factory().delete(component_key(bad, "optim"))
    st2 = open_store()  # restart: falls back to 240
    assert st2.resumed_from.step == 240
    ref = save(st2, 280)
    r = reader(backend_factory)
    assert r.latest_complete(deep=True).save_id == ref.save_id
    states = {(i.step, i.attempt): i.state for i in r.list_saves()}
    assert states[(280, 1)] is SaveState.SUPERSEDED


def test_fresh_start_supersedes_everything(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    save(st, 1)
    save(st, 2)
    fresh = open_store(resume_from=None)
    assert fresh.resumed_from is None
    assert reader(backend_factory).latest_complete() is None
    save(fresh, 1)
    assert reader(backend_factory).latest_complete().attempt == 2


def test_explicit_resume_step(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    for s in (1, 2, 3):
        save(st, s)
    open_store(resume_from=2)
    assert reader(backend_factory).latest_complete().step == 2


# ------------------------------------------------------------ events


def test_events_read_back_in_order_with_their_attempt(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    st.record_event("interruption", {"step": 5, "signal": "SIGKILL"})
    st.record_event("budget", {"spent": 1.5})
    ev = reader(backend_factory).events()
    assert [e["event"] for e in ev] == ["interruption", "budget"]
    assert ev[0]["payload"]["step"] == 5 and ev[0]["attempt"] == 1


# ------------------------------------------------------------ bad input

# Names, data, run IDs and steps are validated before the backend is touched
# (validate_component_name / check_data / validate_run_id in the core), the
# same code whatever the backend; each check runs on memory, local disk and one
# object store, which also shows that nothing reaches an object store's listing.
# (Valid puts, listings and commits run on every backend in the rest of this file.)
INPUT_CHECK_BACKENDS = pytest.mark.backends("memory", "local", "fakegcs")


@INPUT_CHECK_BACKENDS
@pytest.mark.parametrize(
    "name",
    ["../escape", "/abs", "a/../../b", "a//b", "a\\b", ".hidden", "", "a/./b", "x" * 600, "a/" + P.RESERVED_MARK + "x"],
)
def test_bad_component_names_write_nothing(open_store, backend_factory, name) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)  # counts the objects under saves/
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = backend_factory().list("run/saves/")
    with st.save(1) as s:
        with pytest.raises(InvalidInputError):
            s.put(name, b"data")
        s.put("ok", b"data")
    assert len(backend_factory().list("run/saves/")) == len(before) + 1


@INPUT_CHECK_BACKENDS
@pytest.mark.parametrize("data", ["text", 42, None, {"a": 1}, [1, 2], 3.5])
def test_bad_data_is_refused(open_store, data) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    with st.save(1) as s:
        with pytest.raises(InvalidInputError):
            s.put("x", data)
        s.put("y", b"ok")
    assert list(st.latest_complete().components) == ["y"]


def test_duplicate_and_clashing_component_names(open_store) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    with st.save(1) as s:
        s.put("a", b"1")
        with pytest.raises(InvalidInputError):
            s.put("a", b"2")
        with pytest.raises(InvalidInputError):
            s.put("a/b", b"2")


@INPUT_CHECK_BACKENDS
@pytest.mark.parametrize("run_id", ["", "a/b", "../x", ".x", "x" * 200, " sp"])
def test_invalid_run_ids_refused_before_anything_is_written(backend_factory, run_id) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInputError):
        CheckpointStore.open(backend_factory(), run_id, identity=IDENT)
    assert backend_factory().list("") == []


@INPUT_CHECK_BACKENDS
@pytest.mark.parametrize("step", [-1, 1.5, "3", True, P.MAX_STEP + 1])
def test_invalid_steps_refused(open_store, step) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    with pytest.raises(InvalidInputError):
        st.save(step)


def test_empty_or_unencodable_identity_refused_and_nothing_written(backend_factory) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidInputError):
        CheckpointStore.open(backend_factory(), "r", identity={})
    with pytest.raises(InvalidInputError):
        CheckpointStore.open(backend_factory(), "r", identity={"x": object()})
    with pytest.raises(InvalidInputError, match="identity"):
        CheckpointStore.open(backend_factory(), "r", mode="w")
    assert backend_factory().list("") == []


def test_save_from_closed_writer_refused(open_store) -> None:  # type: ignore[no-untyped-def]
    st = open_store()
    with st.save(1) as s:
        s.put("a", b"1")
    with pytest.raises(InvalidInputError):
        s.put("b", b"2")


def test_large_component_hash_matches(open_store) -> None:  # type: ignore[no-untyped-def]
    import blake3

    st = open_store(options=V2)  # version 3's blake3 is of the list of its pieces (PROTOCOL.md §9.2)
    data = os.urandom(20 * 1024 * 1024 + 123)
    with st.save(1) as s:
        entry = s.put("big", data)
    assert entry.blake3 == blake3.blake3(data).hexdigest()
    ref = st.latest_complete(deep=True)
    assert st.read(ref, "big") == data


def test_gc_keeps_the_good_save_behind_an_undetected_bit_flip(open_store, backend_factory) -> None:  # type: ignore[no-untyped-def]
    st = open_store(options=V2)
    good = save(st, 1)
    bad = save(st, 2)
    b = backend_factory()
    data = bytearray(blob(2, "model"))
    data[10] ^= 0x04  # same size: only a re-hash sees it
    b.put(component_key(bad, "model"), [bytes(data)])
    st.gc(keep_last=1, grace_seconds=0)
    assert reader(backend_factory).latest_complete(deep=True).save_id == good.save_id
