"""An uncommitted version-3 save is reported like a version-2 one (PROTOCOL.md
§9.5 "Listing uncommitted saves"): a save that wrote pieces and no commit is
a skipped candidate of ``latest_complete(explain=True)`` ("no-commit"), so the
operator record lists it among the discarded checkpoints (the seeds' scenario:
a save interrupted at step 280 after the last complete one at 240)."""

from __future__ import annotations

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.protocol.selection import SkipReason
from tests.incremental.common import FROZEN, IDENT, RUN, head, long_timing, open_store, save


def test_an_interrupted_save_of_pieces_is_skipped_with_no_commit(backend: Backend) -> None:
    w = open_store(backend)
    save(w, 240)
    staged = w.stage(280)  # interrupted while writing: pieces, no commit
    staged.put("model", [memoryview(FROZEN), memoryview(head(280))])
    sel = CheckpointStore.open(backend, RUN, piece_timing=long_timing()).latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 240
    assert [(s.step, s.reason) for s in sel.skipped] == [(280, SkipReason.NO_COMMIT)]
    assert "piece(s) written, no commit record" in sel.skipped[0].detail
    # and an earlier interrupted save (older than the choice) is not a newer candidate
    again = CheckpointStore.open(backend, RUN, identity=IDENT, piece_timing=long_timing())
    assert again.resumed_from is not None and again.resumed_from.step == 240
