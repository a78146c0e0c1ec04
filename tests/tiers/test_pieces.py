"""Two tiers with pieces (protocol version 3, PROTOCOL.md §"Tiers", "Pieces
and replication"): the replicator uploads only the pieces the durable tier
lacks, resumes read the same bits from either tier, and a gc of the durable
tier while a save is being replicated never deletes a piece that save needs.
A local directory is the fast tier; the durable tier is every backend."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.protocol.selection import SaveRef
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
)

V3 = P.layout_of(3)


def open_tiered(durable: Backend, local: Path, **kw: object) -> CheckpointStore:
    kw.setdefault("piece_timing", long_timing())
    return CheckpointStore.open(durable, RUN, identity=IDENT, protocol_version=3,  # type: ignore[arg-type]
                                local_tier=local, **kw)


def save(store: CheckpointStore, step: int) -> bytes:
    with store.save(step) as w:
        w.put("model", [memoryview(FROZEN), memoryview(head(step))])
        w.put("state.json", f'{{"step": {step}}}'.encode())
    return FROZEN + head(step)


def piece_bytes_put(durable: FaultyBackend, ref: SaveRef, since: int) -> int:
    """Bytes of ``ref``'s pieces uploaded to the durable tier after trace entry ``since``."""
    sizes = {P.layout.piece_key(RUN, h, d): n for (h, d), n in ref.record.piece_refs().items()}
    return sum(sizes.get(t.key, 0) for t in durable.trace[since:] if t.op == "put" and t.outcome == "ok")


def piece_listings(durable: FaultyBackend, since: int, until: int) -> int:
    return sum(1 for t in durable.trace[since:until] if t.op == "list" and "/pieces/" in t.key)


def restore(store: CheckpointStore, ref: SaveRef) -> bytes:
    buf = bytearray(ref.components["model"].size)
    store.read_into(ref, "model", buf)
    return bytes(buf)


def test_a_second_save_replicates_only_its_changed_pieces(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    durable = FaultyBackend(backend_factory())
    # an intent lifetime no step of the test overruns: the standing intent of save 1 is young (less than half
    # its life) however slowly the machine runs, so save 2 is replicated from memory, without listing
    s = open_tiered(durable, tmp_path / "nvme", piece_timing=long_timing())
    save(s, 1)
    assert s.flush(30)
    first = s.latest_complete()
    assert first is not None and first.tier == "both"
    assert piece_bytes_put(durable, first, 0) == sum(first.record.piece_refs().values())
    mark = len(durable.trace)
    model = save(s, 2)
    assert s.flush(30)
    replicated = len(durable.trace)
    second = s.latest_complete(deep=True)
    assert second is not None and (second.step, second.tier) == (2, "both")
    new = {hd: n for hd, n in second.record.piece_refs().items() if hd[0] == second.save_id}
    # only the changed head (and state.json) went up: the frozen part is not uploaded again
    assert piece_bytes_put(durable, second, mark) == sum(new.values()) < len(head(2)) + 100
    assert sum(new.values()) < len(model) // 100
    # known from memory: one listing per holder at most (the landing check), never one per piece
    assert piece_listings(durable, mark, replicated) <= len({h for h, _ in second.record.piece_refs()})
    s.close()
    r = CheckpointStore.open(backend_factory(), RUN, mode="r")
    dref = r.latest_complete(deep=True)
    assert dref is not None and dref.manifest_digest == second.manifest_digest and dref.tier == "durable"
    assert not r.verify(dref).problems
    assert restore(r, dref) == model


def test_resume_from_the_local_and_from_the_durable_tier_bit_for_bit(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme")
    save(s, 1)
    model = save(s, 2)
    assert s.flush(30)
    s.close()
    again = open_tiered(backend_factory(), tmp_path / "nvme")
    ref = again.resumed_from
    assert ref is not None and (ref.step, ref.tier) == (2, "both") and restore(again, ref) == model
    again.close()
    shutil.rmtree(tmp_path / "nvme")  # the VM is replaced: the local tier is gone
    fresh = open_tiered(backend_factory(), tmp_path / "nvme")
    ref = fresh.resumed_from
    assert ref is not None and (ref.step, ref.tier) == (2, "durable") and restore(fresh, ref) == model
    # saving on from the durable copy: the local tier holds nothing, so the local save writes it all,
    # and the durable commit names only pieces that are there
    model3 = save(fresh, 3)
    assert fresh.flush(30)
    ref3 = fresh.latest_complete(deep=True)
    assert ref3 is not None and (ref3.step, ref3.tier) == (3, "both") and restore(fresh, ref3) == model3
    fresh.close()
    r = CheckpointStore.open(backend_factory(), RUN, mode="r")
    dref = r.latest_complete(deep=True)
    assert dref is not None and dref.step == 3 and restore(r, dref) == model3


@pytest.mark.parametrize("intent", ["live", "expired"])
def test_durable_gc_during_replication_never_deletes_a_piece_the_save_needs(
        backend_factory: Callable[[], Backend], tmp_path: Path, intent: str) -> None:
    """Save A is made durable; save B reuses A's pieces. While B's new pieces
    are being uploaded, A's durable commit is removed and a gc of the durable
    tier runs with A's pieces older than the grace period. ``live``: the
    replicator's intent names them and gc keeps them; ``expired``: the intent
    lapsed and gc sweeps them, and the replicator notices before committing and
    uploads them again. Either way B's durable commit verifies and restores.

    Decided by injected clocks, not by waiting: ``live``: the writer's clock is
    moved past half the standing intent's life (B's replication renews it), and
    gc's clock is fixed where A's pieces are just old and B's, written a second
    or more later, young; ``expired``: time passes for the writer and gc alike
    (the standing intent lapses, every piece there is old) while B's replication
    waits at the hook, before it uploaded any piece."""
    inner = backend_factory()
    durable = FaultyBackend(inner)
    clock = Clock()  # the writer's (and its replicator's)
    s = open_tiered(durable, tmp_path / "nvme", piece_timing=long_timing(clock))
    save(s, 1)
    assert s.flush(30)
    a = s.latest_complete()
    assert a is not None
    gclock = clock
    if intent == "live":
        time.sleep(1.1)  # a lower bound only: B's pieces are listed at least a second after A's
        clock.offset = LONG / 2 + 1  # B's replication writes a fresh intent naming A's pieces
        gclock = gc_clock_past(inner, a.save_id)  # A's pieces are old, B's young
    swept: list[int] = []

    def gc_now(op: str, key: str) -> bool:
        if not swept and op == "put" and "/pieces/" in key and a.save_id not in key:
            inner.delete(V3.commit_key(RUN, 1, 1))  # another job's retention took A away
            if intent == "expired":
                age_past_grace(clock)  # the standing intent named A's pieces and lapsed meanwhile
            report = CheckpointStore.open(inner, RUN, piece_timing=long_timing(gclock)).gc(
                keep_last=1, grace_seconds=GRACE)
            swept.append(report.pieces_freed)
        return False

    durable.crash_when(gc_now)  # never crashes: a hook at the first upload of B's own pieces
    model = save(s, 2)
    assert s.flush(30)
    assert swept, "the gc hook did not run"
    b = s.latest_complete()
    assert b is not None and b.step == 2
    reused = {hd for hd in b.record.piece_refs() if hd[0] == a.save_id}
    assert reused  # B does rely on A's pieces
    only_a = set(a.record.piece_refs()) - reused
    if intent == "live":
        assert swept == [len(only_a)]  # what B does not need went; what B reuses stayed
    else:
        assert swept == [len(a.record.piece_refs())]  # gc took them all; the replicator put B's back first
    s.close()
    r = CheckpointStore.open(inner, RUN, mode="r")
    dref = r.latest_complete(deep=True)
    assert dref is not None and dref.step == 2 and dref.manifest_digest == b.manifest_digest
    assert restore(r, dref) == model
