"""Fail closed, issue 18 classes 2 and 4 (protocol_spec/THREATS.md §4.2, §4.4).

Class 2, "gave up" read as "nothing there": a flood of junk commit records
above the newest save makes selection give up, which is an error naming the
cause and the way out — never "no save", never a fresh start registered over
the run's saves. Candidates whose state follows from their names and the
attempt records (superseded, unregistered) are not read and do not count, so a
run rolled back with ``resume_from=10`` past 1,000 saves still resumes. A
writer never resumes from nothing over commits it cannot use.

Class 4, deep folder chains: ``commits/``, ``attempts/`` and ``events/`` are
listed one level, so a chain planted there is not walked; every other walk is
iterative and stops at a depth bound with an error (never RecursionError).

Each test plants objects straight on the storage (memory, local disk, and the
object stores where the listing path differs: S3 via SeaweedFS, GCS via
fake-gcs-server), runs the public API and the CLI, and compares a snapshot of
the store and of a location outside it before and after.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.backends.base import MAX_KEY_DEPTH, Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.fsspec_base import FsspecBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend, named_memory_backend
from ckptstore.backends.schemes import backend_from_url
from ckptstore.cli.commands import main as cli_main
from ckptstore.core import catalog
from ckptstore.errors import LimitReachedError, ResumeRefusedError
from ckptstore.protocol import LATEST_LAYOUT, attempts_prefix, commits_prefix, saves_prefix
from ckptstore.protocol.selection import MAX_CANDIDATES, SkipReason
from tests.helpers import IDENT, RawAccess

#: the object stores: a key is at most 1,024 bytes, so their chains are shallower (still past the bound)
OBJECT_CHAIN = 450
#: past Python's recursion limit (1,000: what made the old walks crash) and four times the bound; deeper
#: costs only test time (a disk removes a few hundred nested folders a second)
LOCAL_CHAIN = 1200
#: rotting whole components under saves/ is version 2's layout (version 3's damaged pieces: tests/incremental)
V2 = OpenOptions(protocol_version=2)


@dataclass
class Where:
    """One store location of the test's backend kind, and one outside it."""

    kind: str
    url: str
    opts: dict[str, Any]
    backend: Backend
    outside: Backend
    cli_args: list[str] = field(default_factory=list)

    def open(self, **kw: Any) -> CheckpointStore:
        return CheckpointStore.open(self.url, "run", storage_options=self.opts or None, **kw)

    def cli(self, *args: str) -> int:
        return cli_main([args[0], self.url, "run", *self.cli_args, *args[1:]])

    def plant(self, objects: dict[str, bytes]) -> None:
        b = self.backend
        if isinstance(b, FsspecBackend):
            b.fs.pipe({f"{b.root}/{k}": v for k, v in objects.items()})
            b.fs.invalidate_cache()
        else:
            raw = RawAccess(b)
            for k, v in objects.items():
                raw.set(k, v)


def _location(kind: str, tmp_path: Path, request: pytest.FixtureRequest, name: str) -> tuple[str, dict[str, Any], Backend]:
    if kind == "memory":
        n = f"fc-{name}-{uuid.uuid4().hex[:8]}"
        return f"memory://{n}", {}, named_memory_backend(n)
    if kind == "local":
        return str(tmp_path / name), {}, LocalBackend(tmp_path / name)
    servers = request.getfixturevalue("object_servers")
    url, opts = servers.url_and_options(kind, f"fc-{name}-{uuid.uuid4().hex[:10]}")
    return url, opts, backend_from_url(url, storage_options=opts)


@pytest.fixture
def where(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Where]:
    url, opts, backend = _location(backend_kind, tmp_path, request, "store")
    _u, _o, outside = _location(backend_kind, tmp_path, request, "outside")
    RawAccess(outside).set("run/saves/precious/model", b"not part of the store under test")
    RawAccess(outside).set("run/commits/keep.txt", b"do not touch")
    args: list[str] = []
    for k, v in opts.items():
        if isinstance(v, str):
            args += ["-o", f"{k}={v}"]
    if "client_kwargs" in opts:
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    yield Where(backend_kind, url, opts, backend, outside, args)
    for b in (backend, outside):
        b.close()


def objects(b: Backend) -> dict[str, bytes]:
    """Ground truth: every object stored under ``b``, read around the backend
    (a local chain is not entered: its folders hold nothing)."""
    if isinstance(b, MemoryBackend):
        with b._lock:  # noqa: SLF001 - ground truth by design
            return {k: v[0] for k, v in b._objects.items()}  # noqa: SLF001
    if isinstance(b, LocalBackend):
        out = {}
        for dirpath, dirs, files in os.walk(b.root):
            dirs[:] = [d for d in dirs if d != "d"]  # the planted chains
            for f in files:
                p = os.path.join(dirpath, f)
                out[os.path.relpath(p, b.root)] = Path(p).read_bytes()
        return out
    assert isinstance(b, FsspecBackend)
    b.fs.invalidate_cache()
    return {p: bytes(b.fs.cat_file(p)) for p in b.fs.find(b.root)}


def changed(before: dict[str, bytes], after: dict[str, bytes]) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def two_saves(w: Where, **kw: Any) -> tuple[CheckpointStore, dict[int, str]]:
    st = w.open(identity=IDENT, **kw)
    ids = {}
    for step in (1, 2):
        with st.save(step) as s:
            s.put("model", f"weights@{step}".encode() * 50)
        assert s.ref is not None
        ids[step] = s.ref.save_id
    st.close()  # a version-3 writer writes its intent in the background: done before the tests' snapshots
    return st, ids


def assert_restorable(w: Where, step: int) -> None:
    r = w.open(mode="r")
    ref = r.get_save(step)
    assert r.read(ref, "model") == f"weights@{step}".encode() * 50
    assert r.verify(ref).ok


def plant_chain(w: Where, prefix: str) -> None:
    """A chain of folders ``d/d/d/...`` under ``prefix`` with one file at its end."""
    if isinstance(w.backend, LocalBackend):
        here = os.getcwd()
        os.makedirs(os.path.join(w.backend.root, *prefix.strip("/").split("/")), exist_ok=True)
        os.chdir(os.path.join(w.backend.root, *prefix.strip("/").split("/")))
        try:
            for _ in range(LOCAL_CHAIN):  # relative steps: the whole path is longer than PATH_MAX
                os.mkdir("d")
                os.chdir("d")
            Path("000000000099.00000001.json").write_bytes(b"x")
        finally:
            os.chdir(here)
        return
    depth = 3000 if isinstance(w.backend, MemoryBackend) else OBJECT_CHAIN
    w.plant({prefix + "d/" * depth + "000000000099.00000001.json": b"x"})


def remove_chain(w: Where, prefix: str) -> None:
    if not isinstance(w.backend, LocalBackend):
        return
    here = os.getcwd()
    os.chdir(os.path.join(w.backend.root, *prefix.strip("/").split("/")))
    try:
        depth = 0
        while os.path.isdir("d"):
            os.chdir("d")
            depth += 1
        for f in os.listdir("."):
            os.unlink(f)
        for _ in range(depth):
            os.chdir("..")
            os.rmdir("d")
    finally:
        os.chdir(here)


@pytest.fixture
def chains(where: Where) -> Iterator[list[str]]:
    """Prefixes to plant chains under; removed again after the test (pytest's
    own clean-up would recurse)."""
    planted: list[str] = []
    yield planted
    for p in planted:
        remove_chain(where, p)


# -- class 2: a bound reached is never "no save" ----------------------------------------------------------


@pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")
def test_a_flood_of_junk_candidates_fails_closed_and_never_restarts_the_run(
    where: Where, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = MAX_CANDIDATES
    if where.kind not in ("memory", "local"):
        # the same walk with a smaller bound: selection reads its candidates one request each, and
        # this test selects four times (1,000 sequential requests each would take a minute)
        bound = 50
        monkeypatch.setattr(catalog, "MAX_CANDIDATES", bound)
    _st, ids = two_saves(where)
    junk = {LATEST_LAYOUT.commit_key("run", 100 + i, 1): b"x" for i in range(bound + 1)}
    where.plant(junk)  # valid names above the newest step, under the registered attempt 1
    before, outside = objects(where.backend), objects(where.outside)

    reader = where.open(mode="r")
    with pytest.raises(LimitReachedError, match="selection gave up") as err:
        reader.latest_complete()
    msg = str(err.value)
    assert "not \"no save\"" in msg and "ckptstore ls" in msg and "resume_from=<step>" in msg
    with pytest.raises(LimitReachedError, match="selection gave up"):
        reader.latest_complete(explain=True)
    with pytest.raises(LimitReachedError, match="selection gave up"):
        where.open(identity=IDENT)  # a writer resuming from "latest": refused, nothing registered
    assert [a.number for a in where.open(mode="r").attempts()] == [1]
    assert [e["event"] for e in where.open(mode="r").events()][-1:] == ["resume-refused"]

    assert where.cli("latest") == 1
    err_out = capsys.readouterr().err
    assert "selection gave up" in err_out and "Traceback" not in err_out and len(err_out.strip().splitlines()) == 1
    assert where.cli("ls") == 0
    out = capsys.readouterr().out
    assert ids[2] in out and ids[1] in out
    assert where.cli("gc", "--apply", "--grace", "0") == 0
    capsys.readouterr()

    ch = changed(before, objects(where.backend))
    assert all("/events/" in k for k in ch), sorted(ch)[:5]  # only the refusal's ledger entry was written
    assert objects(where.outside) == outside
    assert_restorable(where, 1)
    assert_restorable(where, 2)

    # the way out the message names: an explicit resume point (the junk is then superseded, skipped by name)
    w2 = where.open(identity=IDENT, resume_from=2)
    with w2.save(3) as s:
        s.put("model", b"weights@3" * 50)
    latest = where.open(mode="r").latest_complete()
    assert latest is not None and latest.step == 3
    resumed = where.open(identity=IDENT).resumed_from
    assert resumed is not None and resumed.save_id == latest.save_id


@pytest.mark.backends("memory", "local")
def test_a_run_rolled_back_past_a_thousand_saves_resumes_from_its_resume_point(where: Where) -> None:
    # the history is written through the public API in memory (1,100 fsynced saves on a disk cost
    # half a minute) and copied onto the disk under test as it is
    mem = MemoryBackend()
    st = CheckpointStore.open(mem, "run", identity=IDENT)
    last = 1100
    for step in range(1, last + 1):
        with st.save(step) as s:
            s.put("model", f"w{step}".encode())
    rolled = CheckpointStore.open(mem, "run", identity=IDENT, resume_from=10)  # attempt 2: 11..1100 leave the history
    assert rolled.attempt is not None and rolled.attempt.number == 2
    where.plant(objects(mem))

    backend = FaultyBackend(where.backend)
    nxt = CheckpointStore.open(backend, "run", identity=IDENT)  # attempt 3, resuming from "latest"
    assert nxt.resumed_from is not None and (nxt.resumed_from.step, nxt.resumed_from.attempt) == (10, 1)
    assert nxt.read(nxt.resumed_from, "model") == b"w10"
    reads = [t for t in backend.trace if t.op in ("get", "get_range", "get_many")]
    assert len(reads) < 40, f"{len(reads)} reads: superseded candidates must not be read"

    sel = where.open(mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == 10
    assert sel.skipped[0].reason is SkipReason.SUPERSEDED and "record not read" in sel.skipped[0].detail
    assert len(sel.skipped) + sel.more_skipped >= last - 10

    with nxt.save(11) as s:
        s.put("model", b"w11-new")
    again = where.open(identity=IDENT)
    assert again.resumed_from is not None and again.resumed_from.step == 11
    assert again.read(again.resumed_from, "model") == b"w11-new"
    assert cli_main(["latest", where.url, "run"]) == 0


@pytest.mark.backends("memory", "local", "seaweedfs")
def test_a_writer_never_resumes_from_nothing_over_commits_it_cannot_use(where: Where) -> None:
    _st, ids = two_saves(where, options=V2)
    raw = RawAccess(where.backend)
    for sid in ids.values():  # every save loses its bytes (bit rot, a botched copy)
        raw.set(f"run/saves/{sid}/model", b"rotten")
    before, outside = objects(where.backend), objects(where.outside)
    with pytest.raises(ResumeRefusedError) as err:
        where.open(identity=IDENT)
    msg = str(err.value)
    assert "2 commit record(s) in its history and none can be selected" in msg
    assert "size-mismatch" in msg and "resume_from=None" in msg and "ckptstore ls" in msg
    assert [a.number for a in where.open(mode="r").attempts()] == [1]  # nothing registered
    events = where.open(mode="r").events()
    assert events[-1]["event"] == "resume-refused" and "none can be selected" in events[-1]["payload"]["error"]
    ch = changed(before, objects(where.backend))
    assert ch and all("/events/" in k for k in ch)
    assert objects(where.outside) == outside
    # explicit: a deliberate fresh start is the operator's choice
    fresh = where.open(identity=IDENT, resume_from=None)
    assert fresh.attempt is not None and fresh.attempt.resumed_from is None


@pytest.mark.backends("memory", "local")
def test_junk_of_unregistered_attempts_does_not_block_a_fresh_run(where: Where) -> None:
    where.open(identity=IDENT)  # attempt 1, nothing saved
    where.plant({LATEST_LAYOUT.commit_key("run", 5 + i, 77): b"x" for i in range(3)})
    st = where.open(identity=IDENT)  # their state follows from their names: not in the history
    assert st.resumed_from is None and st.attempt is not None and st.attempt.number == 2


# -- class 4: flat prefixes, bounded walks ------------------------------------------------------------------


@pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")
def test_deep_chains_under_commits_and_attempts_are_not_walked(
    where: Where, chains: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    _st, ids = two_saves(where)
    for prefix in (commits_prefix("run"), attempts_prefix("run")):
        chains.append(prefix)
        plant_chain(where, prefix)
    before, outside = objects(where.backend), objects(where.outside)

    sel = where.open(mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == ids[2]
    assert [i.save_id for i in where.open(mode="r").list_saves()] == [ids[2], ids[1]]
    assert where.cli("latest") == 0
    assert "step 2" in capsys.readouterr().out
    assert where.cli("ls") == 0
    assert ids[1] in capsys.readouterr().out
    assert where.cli("gc", "--apply", "--grace", "0") == 0
    assert "deleted 0 save(s)" in capsys.readouterr().out
    assert changed(before, objects(where.backend)) == set()  # the chains stay: not ckptstore's to delete
    assert objects(where.outside) == outside
    assert_restorable(where, 2)

    w = where.open(identity=IDENT)  # a writer's open lists attempts/ and commits/ one level
    assert w.resumed_from is not None and w.resumed_from.save_id == ids[2]
    assert w.read(w.resumed_from, "model") == b"weights@2" * 50


@pytest.mark.backends("memory", "local", "seaweedfs", "fakegcs")
def test_a_deep_chain_under_saves_stops_listing_with_an_error_and_costs_no_save(
    where: Where, chains: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    _st, ids = two_saves(where)
    prefix = saves_prefix("run") + "000000000003-00000001-0123456789ab/"
    chains.append(prefix)
    plant_chain(where, prefix)
    before, outside = objects(where.backend), objects(where.outside)

    with pytest.raises(LimitReachedError, match=f"deeper than {MAX_KEY_DEPTH} levels") as err:
        where.open(mode="r").list_saves()
    assert "Remove the chain by hand" in str(err.value)
    assert where.cli("ls") == 1
    assert "deeper than" in capsys.readouterr().err
    assert where.cli("gc", "--apply", "--grace", "0") == 1
    e = capsys.readouterr().err
    assert "deeper than" in e and "Recursion" not in e

    # selection lists only its candidates' own saves: it still selects, and says what it could not report
    sel = where.open(mode="r").latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.save_id == ids[2]
    assert any("uncommitted saves not reported" in n for n in sel.notes), sel.notes
    assert where.cli("latest") == 0
    capsys.readouterr()
    assert changed(before, objects(where.backend)) == set()
    assert objects(where.outside) == outside
    w = where.open(identity=IDENT)
    assert w.resumed_from is not None and w.resumed_from.save_id == ids[2]


def test_the_local_walk_is_iterative_and_bounded(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path / "s")
    b.put("a/b/c", [b"1"])
    w = Where("local", str(tmp_path / "s"), {}, b, b)
    plant_chain(w, "a/deep/")
    try:
        assert [o.key for o in b.list("a/b/")] == ["a/b/c"]
        assert b.list_keys("a/", flat=True) == [] and b.list("a/", flat=True) == []
        with pytest.raises(LimitReachedError):
            b.list("a/")
        with pytest.raises(LimitReachedError):
            b.list_keys("a/")
        assert b.list_incomplete("a/", older_than=1e12) == []  # no temporary file can lie below any key
    finally:
        remove_chain(w, "a/deep/")
