"""Pieces addressed by content (PROTOCOL.md §9.1-9.2), on every backend: what
did not change is not written again, every read still verifies, deep
verification hashes each piece once, version-2 runs are written as before,
and records that lie about their pieces are unreadable."""

from __future__ import annotations

import pytest

from ckptstore import CheckpointStore, CorruptionError, OpenOptions, SaveAbortedError
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.protocol.pieces import PACK_BYTES, PIECE_BYTES, cut_pieces
from ckptstore.protocol.records import CommitRecord
from tests.helpers import RawAccess
from tests.incremental.common import FROZEN, IDENT, RUN, head, open_store, save


def test_second_save_writes_only_what_changed(backend: Backend) -> None:
    store = open_store(backend)
    save(store, 1)
    ref1 = store.latest_complete()
    assert ref1 is not None and ref1.record.bytes_written() == ref1.total_bytes
    model2 = save(store, 2)
    ref2 = store.latest_complete(deep=True)
    assert ref2 is not None and ref2.step == 2
    written = ref2.record.bytes_written()
    assert written < len(head(2)) + PACK_BYTES + 100  # the head's piece (with the packed tail) and state.json
    assert store.read(ref2, "model") == model2
    buf = bytearray(ref2.components["model"].size)
    store.read_into(ref2, "model", buf)
    assert bytes(buf) == model2
    assert store.read_range(ref2, "model", PIECE_BYTES - 3, PIECE_BYTES + 3) == model2[PIECE_BYTES - 3 : PIECE_BYTES + 3]
    assert store.read(ref2, "model") == model2
    assert store.verify(ref2).ok
    listed = {i.step: i for i in store.list_saves()}
    assert listed[2].bytes_written == written and listed[2].bytes_referenced == len(model2) + len(b'{"step": 2}')


def test_deep_verification_hashes_each_piece_once(backend: Backend) -> None:
    store = open_store(backend)
    for step in (1, 2, 3):
        save(store, step)
    reader = CheckpointStore.open(backend, RUN)
    report = reader.gc(keep_last=3, dry_run=True)
    hashed = report.bytes_read
    distinct = sum({(p.holder, p.digest): p.size for i in reader.list_saves() if i.ref
                    for c in i.ref.components.values() for p in c.pieces or ()}.values())
    assert report.deleted_saves == [] and hashed == distinct


def test_a_flipped_piece_is_never_restored(backend: Backend) -> None:
    store = open_store(backend)
    save(store, 1)
    save(store, 2)
    ref = store.latest_complete()
    assert ref is not None
    p = ref.components["model"].pieces[0]  # type: ignore[index]  # shared by both saves
    key = P.layout.piece_key(RUN, p.holder, p.digest)
    raw = RawAccess(backend)
    data = bytearray(raw.get(key))
    data[100] ^= 1
    raw.set(key, bytes(data))
    with pytest.raises(CorruptionError):
        store.read(ref, "model")
    with pytest.raises(CorruptionError):
        store.read_into(ref, "model", bytearray(ref.components["model"].size))
    assert not store.verify(ref).ok
    assert CheckpointStore.open(backend, RUN).latest_complete(deep=True) is None


def test_missing_piece_aborts_the_save_before_its_commit(backend: Backend) -> None:
    store = open_store(backend)
    save(store, 1)
    ref = store.latest_complete()
    assert ref is not None
    p = ref.components["model"].pieces[0]  # type: ignore[index]
    with pytest.raises(SaveAbortedError, match="missing"), store.save(2) as w:
        w.put("model", [memoryview(FROZEN), memoryview(head(2))])  # relies on the piece
        backend.delete(P.layout.piece_key(RUN, p.holder, p.digest))  # gone before the publish check
    assert [i.step for i in store.list_saves() if i.ref] == []


def test_version_2_runs_are_written_as_today(backend: Backend) -> None:
    store = CheckpointStore.open(backend, "v2", identity=IDENT, options=OpenOptions(protocol_version=2))
    with store.save(1) as w:
        w.put("model", FROZEN)
    keys = backend.list_keys("v2/")
    assert not any("/pieces/" in k or "/intents/" in k for k in keys)
    assert store.run_record["protocol_version"] == 2
    ref = store.latest_complete(deep=True)
    assert ref is not None and ref.components["model"].pieces is None and store.read(ref, "model") == FROZEN


def test_records_that_lie_about_their_pieces_are_unreadable(backend: Backend) -> None:
    store = open_store(backend)
    save(store, 1)
    ref = store.latest_complete()
    assert ref is not None
    rec = ref.record.to_record()
    key = P.layout_of(3).commit_key(RUN, 1, 1)
    for mutate in (
        lambda r: r["components"]["model"]["pieces"][0].__setitem__(2, 7),  # sizes no longer add up
        lambda r: r["components"]["model"]["pieces"].reverse(),  # digest of the list changes
        lambda r: r["components"]["model"]["pieces"][0].__setitem__(0, "../x"),  # holder not a save ID
        lambda r: r.__setitem__("protocol_version", 2),  # pieces in a version-2 record
    ):
        bad = {**rec, "components": {n: {**c, "pieces": [list(p) for p in c.get("pieces", [])]} if "pieces" in c else c
                                     for n, c in rec["components"].items()}}
        mutate(bad)
        with pytest.raises(CorruptionError):
            CommitRecord.decode(P.canonical_json(bad), key, run_id=RUN, step=1, attempt=1)


def test_cut_points_follow_buffer_sizes_only() -> None:
    a = [memoryview(bytes([i]) * n) for i, n in enumerate([10, PACK_BYTES - 5, 3 * PIECE_BYTES + 1, 7])]
    b = [memoryview(bytes([i + 1]) * n) for i, n in enumerate([10, PACK_BYTES - 5, 3 * PIECE_BYTES + 1, 7])]
    sizes_a = [len(p) for p in cut_pieces(a)]
    assert sizes_a == [len(p) for p in cut_pieces(b)] == [PACK_BYTES + 5, PIECE_BYTES, PIECE_BYTES, PIECE_BYTES, 1, 7]
    assert b"".join(bytes(p) for p in cut_pieces(a)) == b"".join(bytes(x) for x in a)
