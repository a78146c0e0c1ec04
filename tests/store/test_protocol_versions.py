"""Protocol versions side by side (PROTOCOL.md §1.1), on every backend.

New runs are version 3 (pieces, PROTOCOL.md §9; commit records named newest
first, as version 2) unless they ask for another version; a run created
under version 1 stays version 1 — read, resumed, written and collected as
such, every record it gains stamped version 1 — so version-1 writers can keep
using it; one store holds both kinds; a name of the other layout inside a run
is history (never selected, never deleted, its save kept; THREATS.md §4.13 —
a run record edited to another version is in tests/fail_closed/test_planted_run_record.py);
and a reader that knows
only version 1 refuses a version-2 run at its run record, before anything else.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import blake3
import pytest

from ckptstore import (
    CheckpointStore,
    CorruptionError,
    InvalidInputError,
    OpenOptions,
    SkipReason,
    StoreUnavailableError,
)
from ckptstore import protocol as P
from ckptstore.backends.base import Backend, Capabilities
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.protocol import records
from ckptstore.testing.invariants import invariant_1_violations
from tests.helpers import IDENT, RawAccess, settle_background_writes

V1_NAME = re.compile(r"^\d{12}\.\d{8}\.json$")
V2_NAME = re.compile(r"^\d{12}\.\d{8}-\d{12}\.\d{8}\.json$")
# version 2 beside version 1, and tests that delete version 2's whole components under saves/ (version 3's
# pieces: tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)


def canon(value: object) -> bytes:
    """Canonical JSON written by hand (PROTOCOL.md §2), not through ckptstore's records."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def plant_v1_run(backend: Backend, run: str, steps: range) -> dict[int, str]:
    """A run exactly as a version-1 writer leaves it, planted raw: run record,
    attempt 1, and one committed save per step. Returns step -> save ID."""
    raw = RawAccess(backend)
    digest = blake3.blake3(canon(IDENT)).hexdigest()
    t = time.time() - 60
    raw.set(f"{run}/RUN.json", canon({
        "protocol_version": 1, "kind": "run", "run_id": run, "identity": IDENT, "identity_digest": digest,
        "created_at": t, "lineage": None,
    }))
    raw.set(f"{run}/attempts/00000001.json", canon({
        "protocol_version": 1, "kind": "attempt", "run_id": run, "attempt": 1, "resumed_from": None,
        "writer_id": "v1-writer", "created_at": t, "abandons": [], "host": "old-host",
    }))
    sids = {}
    for s in steps:
        sid = sids[s] = f"{s:012d}-00000001-{s:012x}"
        data = f"weights@{s}".encode()
        raw.set(f"{run}/saves/{sid}/model", data)
        raw.set(f"{run}/commits/{s:012d}.00000001.json", canon({
            "protocol_version": 1, "kind": "commit", "run_id": run, "step": s, "attempt": 1, "save_id": sid,
            "writer_id": "v1-writer", "identity_digest": digest, "created_at": t,
            "components": {"model": {"size": len(data), "blake3": blake3.blake3(data).hexdigest()}}, "metadata": {},
        }))
    return sids


def save(st: CheckpointStore, step: int) -> P.selection.SaveRef:
    with st.save(step) as s:
        s.put("model", f"weights@{step}".encode())
    assert s.ref is not None
    return s.ref


def keys(backend: Backend, prefix: str) -> list[str]:
    return [o.key for o in backend.list(prefix)]


def record_versions(backend: Backend, run: str) -> dict[str, object]:
    """protocol_version of every record of the run (everything but component bytes and pieces)."""
    out = {}
    for k in keys(backend, f"{run}/"):
        if f"{run}/saves/" not in k and f"{run}/pieces/" not in k:
            out[k] = json.loads(RawAccess(backend).get(k) or b"{}").get("protocol_version")
    return out


def test_new_runs_are_version_3_and_name_commits_newest_first(backend_factory: Callable[[], Backend]) -> None:
    st = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    for s in (1, 2, 10):
        save(st, s)
    st.record_event("note", {"x": 1})
    st.close()
    b = backend_factory()
    names = [k.rsplit("/", 1)[1] for k in keys(b, "run/commits/")]
    assert all(V2_NAME.match(n) for n in names), names
    assert [P.layout_of(3).parse_commit_name(n) for n in names] == [(10, 1), (2, 1), (1, 1)]  # ascending = newest first
    assert set(record_versions(b, "run").values()) == {3}
    assert st.run_record["protocol_version"] == 3
    assert keys(b, "run/pieces/") and not keys(b, "run/saves/")  # the bytes are pieces
    ref = CheckpointStore.open(b, "run", mode="r").latest_complete(deep=True)
    assert ref is not None and ref.step == 10


def test_a_new_run_is_version_3_whatever_else_it_asks_for(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """``options.new_run_version`` is the one place the default is decided:
    3 unless ``protocol_version`` says otherwise, early replication included
    (it uploads a version-3 save's new pieces as they are written)."""
    from ckptstore import OpenOptions, TierOptions
    from ckptstore.options import new_run_version

    o = OpenOptions(tiers=TierOptions(tmp_path / "nvme", early_replication=True))
    assert new_run_version(o) == 3 and new_run_version(OpenOptions()) == 3
    assert new_run_version(OpenOptions(protocol_version=1)) == 1
    with CheckpointStore.open(backend_factory(), "early", identity=IDENT, options=o) as st:
        save(st, 1)
        assert st.run_record["protocol_version"] == 3
        assert st.flush(30)


def test_a_version_1_run_is_read_resumed_written_and_collected_as_version_1(
    backend_factory: Callable[[], Backend],
) -> None:
    sids = plant_v1_run(backend_factory(), "old", range(1, 5))
    reader = CheckpointStore.open(backend_factory(), "old", mode="r")
    assert reader.run_record["protocol_version"] == 1
    latest = reader.latest_complete(deep=True)
    assert latest is not None and (latest.step, latest.save_id) == (4, sids[4])
    assert reader.read(latest, "model") == b"weights@4"
    assert reader.get_save(2).save_id == sids[2]
    assert [i.step for i in reader.list_saves()] == [4, 3, 2, 1]
    assert reader.latest_complete(explain=True).skipped == []

    writer = CheckpointStore.open(backend_factory(), "old", identity=IDENT)  # no version asked: the run's own
    assert writer.resumed_from is not None and writer.resumed_from.step == 4
    assert writer.attempt is not None and writer.attempt.number == 2
    save(writer, 5)
    save(writer, 6)
    writer.record_event("note", {"x": 1})
    b = backend_factory()
    assert all(V1_NAME.match(k.rsplit("/", 1)[1]) for k in keys(b, "old/commits/"))
    assert set(record_versions(b, "old").values()) == {1}  # every record a v1 reader can read

    rep = writer.gc(keep_last=2, grace_seconds=0)
    assert sorted(rep.kept) == sorted([writer.get_save(5).save_id, writer.get_save(6).save_id])
    assert {sid for sid, _ in rep.deleted_saves} == set(sids.values())
    assert [k.rsplit("/", 1)[1] for k in keys(b, "old/commits/")] == ["000000000005.00000002.json",
                                                                      "000000000006.00000002.json"]
    again = CheckpointStore.open(backend_factory(), "old", mode="r").latest_complete(deep=True)
    assert again is not None and again.step == 6
    assert invariant_1_violations(b, "old") == []


def test_protocol_version_1_is_asked_for_at_creation_and_kept(backend_factory: Callable[[], Backend]) -> None:
    st = CheckpointStore.open(backend_factory(), "compat", identity=IDENT, protocol_version=1)
    save(st, 3)
    b = backend_factory()
    assert [k.rsplit("/", 1)[1] for k in keys(b, "compat/commits/")] == ["000000000003.00000001.json"]
    assert set(record_versions(b, "compat").values()) == {1}
    # reopening: the run's own version, asked for or not; another is refused
    assert CheckpointStore.open(b, "compat", identity=IDENT).resumed_from is not None
    assert CheckpointStore.open(b, "compat", mode="r", protocol_version=1).latest_complete() is not None
    with pytest.raises(InvalidInputError, match="protocol version 1"):
        CheckpointStore.open(b, "compat", identity=IDENT, protocol_version=2)
    CheckpointStore.open(b, "new", identity=IDENT, options=V2)
    with pytest.raises(InvalidInputError, match="protocol version 2"):
        CheckpointStore.open(b, "new", mode="r", protocol_version=1)
    with pytest.raises(InvalidInputError):
        CheckpointStore.open(b, "never", identity=IDENT, protocol_version=P.PROTOCOL_VERSION + 1)
    assert keys(b, "never/") == []


@pytest.mark.parametrize("version", [1, 2])
def test_both_versions_order_attempts_of_one_step_newest_first(
    backend_factory: Callable[[], Backend], version: int
) -> None:
    first = CheckpointStore.open(backend_factory(), "run", identity=IDENT, protocol_version=version)
    for s in (1, 2, 3):
        save(first, s)
    again = CheckpointStore.open(backend_factory(), "run", identity=IDENT, resume_from=1)  # forks after step 1
    redo = save(again, 2)
    reader = CheckpointStore.open(backend_factory(), "run", mode="r")
    sel = reader.latest_complete(explain=True)
    assert sel.latest is not None and (sel.latest.step, sel.latest.attempt) == (2, 2) and sel.latest == redo
    assert [(k.step, k.attempt, k.reason) for k in sel.skipped] == [(3, 1, SkipReason.SUPERSEDED)]
    assert [(i.step, i.attempt, i.state.value) for i in reader.list_saves()] == [
        (3, 1, "superseded"), (2, 2, "committed"), (2, 1, "superseded"), (1, 1, "committed")]
    assert reader.get_save(2).attempt == 2 and reader.get_save(2, 1).attempt == 1


def test_one_store_holds_both_kinds_and_names_of_the_other_layout_are_history(
    backend_factory: Callable[[], Backend],
) -> None:
    b = backend_factory()
    plant_v1_run(b, "old", range(1, 3))
    new = CheckpointStore.open(b, "new", identity=IDENT)
    for s in (1, 2):
        save(new, s)
    raw = RawAccess(b)
    # a v1-named copy of the new run's newest record, for a later step, and a
    # v2-named one in the old run: each is history of the other naming, with a save folder of its own
    newest_new = raw.get(P.LAYOUT_V2.commit_key("new", 2, 1))
    newest_old = raw.get("old/commits/000000000002.00000001.json")
    assert newest_new is not None and newest_old is not None
    planted = {P.LAYOUT_V1.commit_key("new", 99, 1): newest_new, P.LAYOUT_V2.commit_key("old", 99, 1): newest_old}
    for run in ("old", "new"):
        planted[f"{run}/saves/000000000099-00000001-{99:012x}/model"] = b"planted bytes"
    for k, v in planted.items():
        raw.set(k, v)
    for run in ("old", "new"):
        st = CheckpointStore.open(backend_factory(), run, identity=IDENT)
        sel = st.latest_complete(explain=True)
        assert sel.latest is not None and sel.latest.step == 2, run
        assert sel.skipped == [] and any("follow another protocol version's commit naming" in n
                                         for n in sel.notes), sel
        listed = [(i.step, i.state.value) for i in st.list_saves()]
        assert listed == [(99, "corrupt"), (2, "committed"), (1, "committed")], listed  # the other naming's save: kept
        st.gc(keep_last=1, grace_seconds=0)
    for k, v in planted.items():
        assert raw.get(k) == v  # never deleted: not ckptstore's
    for run in ("old", "new"):
        assert invariant_1_violations(b, run) == []


def test_a_reader_that_knows_only_version_1_refuses_a_version_2_run(
    backend_factory: Callable[[], Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = backend_factory()
    save(CheckpointStore.open(b, "new", identity=IDENT, options=V2), 1)
    plant_v1_run(b, "old", range(1, 2))
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    before = {k: RawAccess(b).get(k) for k in keys(b, "")}
    monkeypatch.setattr(records, "PROTOCOL_VERSION", 1)  # what a version-1 release checks
    for kw in ({"mode": "r"}, {"identity": IDENT}):
        with pytest.raises(P.UnsupportedVersion, match="protocol_version 2.*reads up to 1.*Upgrade"):
            CheckpointStore.open(backend_factory(), "new", **kw)  # type: ignore[arg-type]
    assert {k: RawAccess(b).get(k) for k in keys(b, "")} == before  # nothing written, nothing deleted
    old = CheckpointStore.open(backend_factory(), "old", mode="r").latest_complete()
    assert old is not None and old.step == 1  # version-1 runs of the same store still open


def test_a_run_of_a_newer_version_is_not_opened(backend_factory: Callable[[], Backend]) -> None:
    plant_v1_run(backend_factory(), "future", range(1, 2))
    raw = RawAccess(backend_factory())
    rec = json.loads(raw.get("future/RUN.json") or b"{}")
    rec["protocol_version"] = P.PROTOCOL_VERSION + 1
    raw.set("future/RUN.json", canon(rec))
    with pytest.raises(CorruptionError, match="Upgrade"):
        CheckpointStore.open(backend_factory(), "future", mode="r")
    with pytest.raises(CorruptionError, match="Upgrade"):
        CheckpointStore.open(backend_factory(), "future", identity=IDENT)
    assert raw.get("future/commits/000000000001.00000001.json") is not None


def test_junk_in_the_newest_first_listing_hides_nothing(backend_factory: Callable[[], Backend]) -> None:
    st = CheckpointStore.open(backend_factory(), "run", identity=IDENT)
    for s in (1, 2, 3):
        newest = save(st, s)
    raw = RawAccess(backend_factory())
    junk = {
        "run/commits/!junk": b"x",
        "run/commits/0": b"x",
        "run/commits/000000000000.00000000.json": b"x",  # v1-shaped, step 0 attempt 0
        "run/commits/00/deeper.json": b"x",
        "run/commits/999999999997.99999998-000000000001.00000001.json": b"x",  # halves disagree
        # valid names sorting first: attempt 99999999 (never registered) and a junk record of attempt 1
        P.LAYOUT_V2.commit_key("run", P.MAX_STEP, P.MAX_ATTEMPT): b"{}",
        P.LAYOUT_V2.commit_key("run", 500, 1): b"junk",
    }
    for k, v in junk.items():
        raw.set(k, v)
    sel = CheckpointStore.open(backend_factory(), "run", mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == newest.save_id
    assert [(k.step, k.reason) for k in sel.skipped] == [
        (P.MAX_STEP, SkipReason.UNREGISTERED_ATTEMPT), (500, SkipReason.UNREADABLE_RECORD)]
    # the names the walk met before the newest commit that do not parse (the fifth sorts after it;
    # the folder 00/ is not listed at all: commits/ is flat)
    assert any(n.startswith("3 name(s) under commits/") for n in sel.notes), sel.notes
    st.gc(keep_last=1, grace_seconds=0)
    assert all(raw.get(k) == v for k, v in junk.items() if P.LAYOUT_V2.parse_commit_name(k.split("/", 2)[2]) is None)
    assert CheckpointStore.open(backend_factory(), "run", mode="r").latest_complete() is not None


# -- memory only: costs and the listing's order ---------------------------------------------------------------


def test_thousands_of_junk_names_cost_listing_not_record_reads() -> None:
    mem = MemoryBackend()
    st = CheckpointStore.open(mem, "run", identity=IDENT)
    newest = save(st, 7)
    raw = RawAccess(mem)
    for i in range(3000):
        raw.set(f"run/commits/0{i:06d}-junk", b"x")  # all sort before every real name
    counting = FaultyBackend(mem)
    ref = CheckpointStore.open(counting, "run", mode="r").latest_complete()
    assert ref is not None and ref.save_id == newest.save_id
    reads = [t for t in counting.trace if t.op in ("get", "get_range") and "/commits/" in t.key]
    assert len(reads) == 1, counting.format_trace()


class PagedMemory(MemoryBackend):
    """A memory backend that asks to be read in pages, like an object store."""

    capabilities = Capabilities(atomic_create=True, consistent_list=True, list_pages=True)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int | None]] = []

    def list_keys(self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False) -> list[str]:
        self.calls.append((start_after, limit))
        return super().list_keys(prefix, start_after=start_after, limit=limit, flat=flat)


class Shuffled(PagedMemory):
    def list_keys(self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False) -> list[str]:
        return list(reversed(super().list_keys(prefix, start_after=start_after, limit=limit, flat=flat)))


class Stuck(PagedMemory):
    def list_keys(self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False) -> list[str]:
        return super().list_keys(prefix, limit=limit, flat=flat)  # ignores start_after


def test_selection_asks_for_small_pages_and_only_as_many_as_it_needs() -> None:
    mem = PagedMemory()
    st = CheckpointStore.open(mem, "run", identity=IDENT, options=V2)
    for s in range(300):
        save(st, s)
    # the newest 200 saves lose their bytes: selection must page past them
    for s in range(100, 300):
        mem.delete(P.component_key("run", st.get_save(s).save_id, "model"))
    mem.calls = []
    ref = CheckpointStore.open(mem, "run", mode="r").latest_complete()
    assert ref is not None and ref.step == 99
    commit_pages = [c for c in mem.calls if c[1] is not None]
    assert [limit for _, limit in commit_pages] == [16, 128, 1000]


@pytest.mark.parametrize("broken", [Shuffled, Stuck])
def test_a_listing_out_of_order_is_an_error_not_an_older_selection(broken: type[PagedMemory]) -> None:
    mem = broken()
    st = CheckpointStore.open(MemoryBackend(), "run", identity=IDENT, options=V2)
    for s in range(40):
        save(st, s)
    for s in range(20, 40):  # the newest 20 lost their bytes: selection needs a second page
        st.backend.delete(P.component_key("run", st.get_save(s).save_id, "model"))
    for k in keys(st.backend, ""):
        mem.put(k, [RawAccess(st.backend).get(k) or b""])
    with pytest.raises(StoreUnavailableError, match="out of order"):
        CheckpointStore.open(mem, "run", mode="r").latest_complete()


def test_list_saves_reads_each_record_once_per_store() -> None:
    mem = MemoryBackend()
    st = CheckpointStore.open(mem, "run", identity=IDENT)
    for s in range(20):
        save(st, s)
    counting = FaultyBackend(mem)
    reader = CheckpointStore.open(counting, "run", mode="r")

    def commit_reads() -> Iterator[str]:
        return (t.key for t in counting.trace if t.op in ("get", "get_range") and "/commits/" in t.key)

    assert [i.state.value for i in reader.list_saves()] == ["committed"] * 20
    assert len(list(commit_reads())) == 20
    counting.trace.clear()
    reader.list_saves()
    reader.gc(keep_last=20, dry_run=True, deep=False)
    assert list(commit_reads()) == []
    # a record deleted and created again under the same name is read again
    key = P.LAYOUT_V2.commit_key("run", 19, 1)
    raw = RawAccess(mem)
    data = raw.get(key)
    assert data is not None
    raw.delete(key)
    time.sleep(0.01)
    raw.set(key, data.replace(b'"metadata":{}', b'"metadata":{"again":1}'))
    infos = reader.list_saves()
    assert list(commit_reads()) == [key]
    assert infos[0].step == 19 and infos[0].ref is not None and infos[0].ref.metadata == {"again": 1}
