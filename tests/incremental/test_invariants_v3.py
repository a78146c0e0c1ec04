"""The shipped raw check of invariant 1 (``ckptstore.testing.invariants``)
judges version-3 commits too: every piece a commit names is present with its
size and BLAKE3."""

from __future__ import annotations

from ckptstore.backends.base import Backend
from ckptstore.protocol.layout import piece_key
from ckptstore.testing.invariants import invariant_1_violations
from tests.helpers import RAW_BY_KIND
from tests.incremental.common import RUN, open_store, save


def test_a_missing_or_changed_piece_violates_invariant_1(backend: Backend, backend_kind: str) -> None:
    w = open_store(backend)
    save(w, 1)
    save(w, 2)
    w.close()
    assert invariant_1_violations(backend, RUN) == []
    ref = w.latest_complete()
    assert ref is not None
    raw = RAW_BY_KIND[backend_kind](backend)
    (own,) = [p for p in ref.record.components["model"].pieces or () if p.holder == ref.save_id]
    key = piece_key(RUN, own.holder, own.digest)
    data = raw.get(key)
    assert data
    raw.set(key, bytes([data[0] ^ 1]) + data[1:])
    assert any("does not match its BLAKE3" in v for v in invariant_1_violations(backend, RUN))
    raw.delete(key)
    assert any("MISSING" in v for v in invariant_1_violations(backend, RUN))
