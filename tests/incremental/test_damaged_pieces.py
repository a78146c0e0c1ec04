"""A shared piece damaged under a live writer (issue 30 class 5, PROTOCOL.md
§9.2 "Evidence", THREATS.md §4.11): a flipped byte or a truncation in a piece
the backbone shares is found by the next save's evidence check, that save
writes the piece again under its own ID and is acknowledged only restorable;
every later save restores bit for bit, and a new writer resumes bit for bit.
Damage that keeps the object's size and time (bit rot on a disk) is found by
the periodic re-hash within REHASH_EVERY saves."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.core.piece_evidence import REHASH_EVERY
from ckptstore.core.pieces import DamagedPieceWarning
from ckptstore.protocol.selection import SaveRef
from tests.helpers import settle_background_writes
from tests.incremental.common import FROZEN, IDENT, RUN, long_timing, save


def open_writer(backend: Backend) -> CheckpointStore:
    return CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing())


def frozen_piece(ref: SaveRef) -> tuple[str, str]:
    """The key of the first (8 MiB) backbone piece ``ref`` names, and its holder."""
    p = ref.components["model"].pieces
    assert p is not None
    return P.layout.piece_key(RUN, p[0].holder, p[0].digest), p[0].holder


def damage(backend: Backend, key: str, how: str) -> None:
    data = bytearray(backend.get(key))
    if how == "flip":
        data[len(data) // 3] ^= 0x01
    else:
        del data[-3:]
    backend.put(key, [bytes(data)])


def restores(backend: Backend, step: int, model: bytes) -> None:
    """A fresh reader selects ``step`` (deep), verifies it and reads it back bit for bit."""
    r = CheckpointStore.open(backend, RUN, mode="r")
    ref = r.latest_complete(deep=True)
    assert ref is not None and ref.step == step
    assert not r.verify(ref, deep=True).problems
    buf = bytearray(len(model))
    r.read_into(ref, "model", buf)
    assert bytes(buf) == model


def snapshot(backend: Backend) -> dict[str, bytes]:
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    return {k: backend.get(k) for k in backend.list_keys("")}


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_shared_piece_is_written_again_and_every_save_restores(backend: Backend, how: str) -> None:
    w = open_writer(backend)
    save(w, 1)
    save(w, 2)  # reuses save 1's backbone
    ref2 = w.latest_complete()
    assert ref2 is not None
    key, holder = frozen_piece(ref2)
    damage(backend, key, how)  # an attacker, or bit rot that rewrote the object
    before = snapshot(backend)
    with pytest.warns(DamagedPieceWarning, match=holder):
        model3 = save(w, 3)
    ref3 = w.latest_complete()
    assert ref3 is not None and ref3.step == 3
    assert frozen_piece(ref3)[1] == ref3.save_id  # written again under the new save, not named again
    assert len(w.damaged_pieces) == 1 and holder in w.damaged_pieces[0]
    restores(backend, 3, model3)  # acknowledged, and restorable
    model4 = save(w, 4)  # and the later saves reuse the fresh copy
    ref4 = w.latest_complete()
    assert ref4 is not None and frozen_piece(ref4)[1] == ref3.save_id
    restores(backend, 4, model4)
    assert before[key] == backend.get(key)  # the damaged object was not touched (gc's to judge)
    w.close()
    again = open_writer(backend)  # a new writer resumes bit for bit and saves on
    assert again.resumed_from is not None and again.resumed_from.step == 4
    restores(backend, 4, model4)
    model5 = save(again, 5)
    restores(backend, 5, model5)
    again.close()


def test_a_missing_shared_piece_is_written_again(backend: Backend) -> None:
    w = open_writer(backend)
    save(w, 1)
    ref1 = w.latest_complete()
    assert ref1 is not None
    key, _ = frozen_piece(ref1)
    backend.delete(key)
    model = save(w, 2)  # nothing to report (gc may sweep a piece whose intent lapsed): written again
    restores(backend, 2, model)
    w.close()


def test_bit_rot_keeping_size_and_time_is_found_by_the_periodic_rehash(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "s")
    w = open_writer(backend)
    save(w, 1)
    ref1 = w.latest_complete()
    assert ref1 is not None
    key, holder = frozen_piece(ref1)
    f = tmp_path / "s" / key
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[100] ^= 0x80
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the listing shows the same size and time
    found = None
    for step in range(2, 2 + REHASH_EVERY + 1):
        with warnings.catch_warnings(record=True) as caught:  # a step may warn of nothing
            warnings.simplefilter("always")
            model = save(w, step)
        if any(issubclass(c.category, DamagedPieceWarning) for c in caught):
            found = step
            break
    assert found is not None and found <= 1 + REHASH_EVERY, "the periodic re-hash never re-read the piece"
    ref = w.latest_complete()
    assert ref is not None and frozen_piece(ref)[1] == ref.save_id != holder
    restores(backend, found, model)
    w.close()


def test_the_first_save_after_a_cheap_resume_rehashes_what_it_reuses(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "s")
    w = open_writer(backend)
    save(w, 1)
    w.close()
    ref = CheckpointStore.open(backend, RUN, mode="r").latest_complete()
    assert ref is not None
    key, holder = frozen_piece(ref)
    damage(backend, key, "flip")
    # a cheap resume checks sizes only: the writer knows nothing of the pieces' bytes yet
    again = CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing(),
                                 resume_verify="cheap")
    with pytest.warns(DamagedPieceWarning, match=holder):
        model = save(again, 2)
    restores(backend, 2, model)
    again.close()


def test_the_periodic_rehash_costs_a_share_of_the_known_pieces_per_save(tmp_path: Path) -> None:
    """The cost side: with nothing changed, a save re-reads at most
    ceil(known / REHASH_EVERY) of the pieces it reuses (the longest unchecked)."""
    backend = FaultyBackend(LocalBackend(tmp_path / "s"))
    w = open_writer(backend)
    save(w, 1)
    ref = w.latest_complete()
    assert ref is not None
    known = len(ref.record.piece_refs())
    for step in range(2, 2 + 2 * REHASH_EVERY):
        mark = len(backend.trace)
        save(w, step)
        read = {t.key for t in backend.trace[mark:] if t.op.startswith("get") and "/pieces/" in t.key}
        assert len(read) <= -(-known // REHASH_EVERY), (step, read)
    w.close()


def test_a_known_piece_is_rehashed_only_when_a_save_reuses_it(tmp_path: Path) -> None:
    """After a cheap resume every known piece lacks evidence, so each must be
    re-hashed before it is reused; a save in which everything changed reuses
    none and reads none (the check is at the reuse, not at the save's start)."""
    backend = FaultyBackend(LocalBackend(tmp_path / "s"))
    w = open_writer(backend)
    save(w, 1)
    w.close()
    again = CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing(),
                                 resume_verify="cheap")
    mark = len(backend.trace)
    save(again, 2, frozen=os.urandom(len(FROZEN)))  # the frozen part changed too: no known piece is reused
    read = {t.key for t in backend.trace[mark:] if t.op.startswith("get") and "/pieces/" in t.key}
    assert read == set(), read
    again.close()
    third = CheckpointStore.open(backend, RUN, identity=IDENT, protocol_version=3, piece_timing=long_timing(),
                                 resume_verify="cheap")
    ref = third.latest_complete()
    assert ref is not None and ref.step == 2
    frozen2 = third.read(ref, "model")[: len(FROZEN)]
    mark = len(backend.trace)
    save(third, 3, frozen=frozen2)  # step 2's frozen part again: its pieces are reused, so re-hashed first
    read = {t.key for t in backend.trace[mark:] if t.op.startswith("get") and "/pieces/" in t.key}
    assert read and all(ref.save_id in k for k in read), read
    third.close()
