"""Crash consistency of a version-3 save (PROTOCOL.md §9), enumerated: the process dies at
every backend operation of a save that both reuses pieces and writes new ones.

The version-2 enumeration (tests/store/test_crash_consistency.py) counts a save's operations
on a first save; a version-3 save's are not those of the first: the second save lists the
pieces of the commit it reuses (and re-hashes some of them, §9.2 "Evidence"), and after its
commit a background thread writes the writer's next intent, removes the old one and lists
the pieces it just wrote (§9.3). Here the operations are counted on an uncrashed second save
of the same shape, intent write included, and the crash points run one past the last of
them, so the points after the commit record are reached too.

After every crash: every commit record names only pieces present with their recorded size
and BLAKE3 (invariant 1, checked raw: ``ckptstore.testing.invariants`` leaves version-3
records unjudged, and selection would quietly skip such a commit); a fresh reader selects
the first save or the second, never anything else, and what it selects verifies deep and
reads back bit for bit; an acknowledged save is never lost; a gc that may sweep everything
no live commit or intent names (the dead writer's intent expired) keeps the selected save
whole; and a new writer resumes from it and saves again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import blake3
import pytest

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import Crashed, FaultyBackend
from ckptstore.errors import NotFoundError
from ckptstore.protocol import commits_prefix
from ckptstore.protocol.layout import piece_key
from ckptstore.protocol.pieces import PACK_BYTES
from ckptstore.protocol.selection import SaveRef
from tests.incremental.common import IDENT, LONG, Clock, long_timing

#: a frozen part of two buffers, each a piece of its own (at least PACK_BYTES: not packed with
#: anything), the same in every save; small enough that an object store takes every crash point
FROZEN = (os.urandom(PACK_BYTES + 4321), os.urandom(PACK_BYTES + 8765))

# a crash in the background intent write after the commit kills that thread (the process died)
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def head(step: int) -> bytes:
    """The part of the model that changes with every save: a piece of its own."""
    seed = f"head@{step}:".encode()
    return (seed * (PACK_BYTES // len(seed) + 2))[: PACK_BYTES + 99]


def model(step: int) -> bytes:
    return FROZEN[0] + FROZEN[1] + head(step)


def state(step: int) -> bytes:
    return json.dumps({"step": step}).encode()


def do_save(store: CheckpointStore, step: int) -> SaveRef:
    with store.save(step) as w:
        w.put("model", [memoryview(FROZEN[0]), memoryview(FROZEN[1]), memoryview(head(step))])
        w.put("state.json", state(step))
    assert w.ref is not None
    return w.ref


def settle(store: CheckpointStore) -> None:
    """Wait for the intent the writer started writing after its last commit (a background thread)."""
    pieces = store._place.pieces  # noqa: SLF001 - the intent write is what the counted operations end with
    assert pieces is not None
    pieces.settle()


def open_writer(backend: Backend, run: str, **kw: object) -> CheckpointStore:
    return CheckpointStore.open(backend, run, identity=IDENT,
                                options=OpenOptions(protocol_version=3, pieces=long_timing()), **kw)  # type: ignore[arg-type]


def v3_invariant_1_violations(backend: Backend, run: str) -> list[str]:
    """Invariant 1 for version 3, read raw: every piece every commit record names is present
    with its recorded size and BLAKE3 (the records as plain JSON, PROTOCOL.md §9.2)."""
    problems = []
    for key in backend.list_keys(commits_prefix(run)):
        try:
            rec = json.loads(backend.get(key))
        except (NotFoundError, ValueError) as exc:
            problems.append(f"{key}: unreadable ({exc})")
            continue
        for name, comp in rec["components"].items():
            for holder, digest, size in comp.get("pieces") or [[None, None, None]]:
                if holder is None:
                    problems.append(f"{key}: component {name!r} has no piece list")
                    continue
                try:
                    data = backend.get(piece_key(run, holder, digest))
                except NotFoundError:
                    problems.append(f"{key}: component {name!r}: piece {holder}/{digest} is MISSING")
                    continue
                if len(data) != size or blake3.blake3(data).hexdigest() != digest:
                    problems.append(f"{key}: component {name!r}: piece {holder}/{digest} does not match")
    return problems


def check_selected(backend: Backend, run: str, first: SaveRef, acked: bool, context: str) -> SaveRef:
    """The selected save is the first or the second, verifies deep and reads back bit for bit."""
    reader = CheckpointStore.open(backend, run, mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None, f"the first save was lost: {context}"
    assert (latest.step, latest.attempt) in ((1, 1), (2, 1)), f"selected {latest}: {context}"
    if latest.step == 1:
        assert not acked, f"an acknowledged save was lost: {context}"
        assert latest.save_id == first.save_id, context
    assert reader.read(latest, "model") == model(latest.step), context
    assert reader.read(latest, "state.json") == state(latest.step), context
    assert reader.verify(latest).ok, context
    return latest


@pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")  # S3 once (moto alone took 22 s of it)
def test_crash_at_every_backend_operation_of_a_pieced_save(backend_factory: Callable[[], Backend]) -> None:
    inner = backend_factory()
    # count the operations of the second save (and of the intent write after its commit) on an uncrashed run
    probe = FaultyBackend(inner)
    st = open_writer(probe, "probe")
    first = do_save(st, 1)
    settle(st)
    start = probe.count
    second = do_save(st, 2)
    settle(st)
    n_ops = probe.count - start
    ops = sorted((t for t in probe.trace if t.n > start), key=lambda t: t.n)
    commit_at = next(t.n - start for t in ops if t.op == "create" and "/commits/" in t.key)
    assert {t.op for t in ops} >= {"put", "create", "delete"}, probe.format_trace()
    reused = {(p.holder, p.digest) for c in second.record.components.values() for p in c.pieces or ()
              if p.holder == first.save_id}
    assert len(reused) == 2, second.record  # the frozen part: reused, not written again
    assert n_ops > commit_at + 1, probe.format_trace()  # operations after the commit: the intent write

    outcomes = {"before": 0, "after": 0}
    after_commit = 0
    for n in range(1, n_ops + 2):
        run = f"r{n}"
        fb = FaultyBackend(inner)
        st = open_writer(fb, run)
        first = do_save(st, 1)
        settle(st)
        base = fb.count
        fb.crash_at(base + n)
        acked = False
        try:
            do_save(st, 2)
            acked = True
            settle(st)  # the intent write: it meets the crash in its own thread
        except Crashed:
            pass
        trace = sorted((t for t in fb.trace if t.n > base), key=lambda t: t.n)
        context = f"crash at op {n} of {n_ops}\n" + "\n".join(map(str, trace))
        assert fb.crashed == (n <= n_ops), context
        if any(t.op == "create" and "/commits/" in t.key and t.outcome == "created" for t in trace) and fb.crashed:
            after_commit += 1

        assert not v3_invariant_1_violations(inner, run), (v3_invariant_1_violations(inner, run), context)
        selected = check_selected(inner, run, first, acked, context)
        outcomes["after" if selected.step == 2 else "before"] += 1

        # a gc after the crash, at a clock past the dead writer's intent and every piece's grace
        gc = CheckpointStore.open(inner, run, mode="r", options=OpenOptions(pieces=long_timing(Clock(offset=LONG + 2))))
        rep = gc.gc(keep_last=1, grace_seconds=LONG)
        assert rep.pieces_refused is None, (rep, context)
        assert not v3_invariant_1_violations(inner, run), context
        again = check_selected(inner, run, first, acked, "after gc; " + context)
        assert again.save_id == selected.save_id, context

        # and a new attempt resumes from it and saves on (reusing what the crash left, where it may)
        writer = open_writer(inner, run)
        assert writer.resumed_from is not None and writer.resumed_from.save_id == selected.save_id, context
        nxt = do_save(writer, selected.step + 1)
        writer.close()
        reader = CheckpointStore.open(inner, run, mode="r")
        latest = reader.latest_complete(deep=True)
        assert latest is not None and latest.save_id == nxt.save_id, context
        assert reader.read(latest, "model") == model(nxt.step), context
    assert outcomes["before"] >= 1 and outcomes["after"] >= 1, outcomes
    assert after_commit >= 1  # crash points after the commit record were reached
