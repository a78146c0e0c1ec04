"""A resumed failed save reuses the pieces its failed attempt uploaded and
that verify (§9.2), and ``pieces_lacking`` names only what another store
lacks (for replication to a durable tier), on every backend."""

from __future__ import annotations

from ckptstore import CheckpointStore, OpenOptions
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.memory import MemoryBackend
from tests.helpers import RawAccess
from tests.incremental.common import FROZEN, RUN, head, open_store, save


def test_a_resumed_failed_save_reuses_its_verified_pieces(backend: Backend) -> None:
    first = open_store(backend)
    save(first, 1)
    other = bytes(reversed(FROZEN))  # step 2 changes everything: nothing of step 1 can be reused
    staged = first.stage(2)
    staged.put("model", [memoryview(other), memoryview(head(2))])  # uploaded; then the job is killed
    left = backend.list_keys(P.layout.pieces_prefix(RUN) + staged.save_id + "/")
    assert left
    flipped = left[0]  # one of them rotted at rest: it must be written again, not reused
    raw = RawAccess(backend)
    data = bytearray(raw.get(flipped))
    data[0] ^= 1
    raw.set(flipped, bytes(data))
    second = open_store(backend)  # attempt 2 resumes from step 1
    model = save(second, 2, frozen=other)
    ref = second.latest_complete(deep=True)
    assert ref is not None and ref.step == 2 and second.read(ref, "model") == model
    reused = [p for p in ref.components["model"].pieces or () if p.holder == staged.save_id]
    flipped_size = len(data)
    assert sum(p.size for p in reused) >= len(other) - flipped_size  # the failed attempt's good pieces
    assert ref.record.bytes_written() <= flipped_size + 100  # the rotted one, and state.json


def test_pieces_lacking_names_what_the_other_store_lacks(backend: Backend) -> None:
    store = open_store(backend)
    save(store, 1)
    save(store, 2)
    ref = store.latest_complete()
    assert ref is not None
    durable = MemoryBackend("durable")
    lacking = store.pieces_lacking(ref, durable)
    assert {(p.holder, p.digest) for p in lacking} == set(ref.record.piece_refs())
    copied = lacking[: len(lacking) // 2 or 1]
    for p in copied:
        key = P.layout.piece_key(RUN, p.holder, p.digest)
        durable.put(key, [backend.get(key)])
    assert store.pieces_lacking(ref, durable) == [p for p in lacking if p not in copied]
    bad = lacking[0]
    durable.put(P.layout.piece_key(RUN, bad.holder, bad.digest), [b"short"])  # wrong size: still lacking
    assert bad in store.pieces_lacking(ref, durable)
    v2 = CheckpointStore.open(backend, "plain", identity={"x": "y"}, options=OpenOptions(protocol_version=2))
    with v2.save(1) as w:
        w.put("model", b"whole")
    ref2 = v2.latest_complete()
    assert ref2 is not None and v2.pieces_lacking(ref2, durable) == []
