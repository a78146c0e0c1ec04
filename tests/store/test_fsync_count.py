"""fsyncs per save on the local disk, pinned (issue 32 item 1; PROTOCOL.md §7.2).

Counts, not timing: every ``os.fsync`` / ``os.fdatasync`` the process issues
while one save runs is counted (all threads; the intent a version-3 save
writes in the background after its commit is waited for and counted with
it), by what it made durable. A change that adds an fsync to a save fails
here; one that removes one must say in §7.2 why crash consistency still holds
and update the numbers. ``bench/rows/fsyncs.py`` prints the same counts by
call site.
"""

from __future__ import annotations

import collections
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.torch import Checkpointer
from tests.helpers import settle_background_writes

IDENT = {"data_digest": "fsync-count"}


class Counts:
    def __init__(self, root: str) -> None:
        self.root = root
        self.by_what: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_what.values())


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, root: str) -> Iterator[Counts]:
    """Count the fsyncs while the block runs, each by the folder (``dir <rel>``)
    or the folder of the file (``file <rel>``) it made durable."""
    settle_background_writes()  # an earlier save's of this test: not this one's
    before = set(threading.enumerate())
    c = Counts(root)
    lock = threading.Lock()
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def what(fd: int) -> str:
        isdir = stat.S_ISDIR(os.fstat(fd).st_mode)
        path = os.readlink(f"/proc/self/fd/{fd}")
        rel = os.path.relpath(path if isdir else os.path.dirname(path), root).split(os.sep)
        # <run>/<folder>[/<save>]: name the folder kind, not the save
        return ("dir " if isdir else "file ") + "/".join(rel[1:2] + (["<save>"] if len(rel) > 2 else []))

    def fsync(fd: int) -> None:
        w = what(fd)
        with lock:
            c.by_what[w] += 1
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        w = "fdatasync " + what(fd)
        with lock:
            c.by_what[w] += 1
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    try:
        yield c
        _join_intent_writes(only_new=before)  # the intent write a version-3 save starts after its commit is this save's
    finally:
        monkeypatch.setattr(os, "fsync", real_fsync)
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)


def _join_intent_writes(only_new: set[threading.Thread]) -> None:
    """Wait for this test's background intent writes (threads named ``ckptstore-intent`` not in ``only_new``)."""
    for t in threading.enumerate():
        if t.name == "ckptstore-intent" and t not in only_new:
            t.join()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)


def _train(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
    o.zero_grad()
    m(torch.randn(4, 64)).pow(2).mean().backward()
    o.step()


#: a Checkpointer save of a model + Adam: components model, optimizer, rng (safetensors) and state.json
CHECKPOINTER = {
    2: {"file saves/<save>": 4,  # each component's bytes, before its rename (fsynced together)
        "dir saves/<save>": 1,  # the four renames, once (put_many)
        "dir saves": 1,  # the new save folder's entry
        "file commits": 1, "dir commits": 1,  # the commit record: its bytes, then its link (the publish)
        "file events": 1},  # the ledger entry's bytes (never torn); its name is not waited for
    3: {"file pieces/<save>": 4,  # each new piece (this small state: one packed piece per component)
        "dir pieces/<save>": 1, "dir pieces": 1, "file commits": 1, "dir commits": 1, "file events": 1,
        "file intents": 1},  # the next save's intent: its bytes (never torn); its name is not waited for
}


@pytest.mark.parametrize("version", [2, 3])
def test_checkpointer_save_fsyncs_are_pinned(tmp_path, monkeypatch, version) -> None:  # type: ignore[no-untyped-def]
    store = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT, options=OpenOptions(protocol_version=version))
    m, o = _model()
    ck = Checkpointer(store, {"model": m, "optimizer": o}, async_save=False, handle_signals=False)
    _train(m, o)
    ck.save(1)
    _train(m, o)
    with counting(monkeypatch, str(tmp_path / "s")) as c:
        ck.save(2)
    ck.close()
    store.close()
    assert dict(c.by_what) == CHECKPOINTER[version], dict(c.by_what)
    assert c.total == (9 if version == 2 else 10)


#: a plain save of one component
PLAIN = {
    2: {"file saves/<save>": 1, "dir saves/<save>": 1, "dir saves": 1, "file commits": 1, "dir commits": 1},
    3: {"file pieces/<save>": 1, "dir pieces/<save>": 1, "dir pieces": 1, "file commits": 1, "dir commits": 1,
        "file intents": 1},
}


@pytest.mark.parametrize("version", [2, 3])
def test_plain_save_fsyncs_are_pinned(tmp_path, monkeypatch, version) -> None:  # type: ignore[no-untyped-def]
    store = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT, options=OpenOptions(protocol_version=version))
    with store.save(1) as s:
        s.put("model", os.urandom(1 << 16))
    with counting(monkeypatch, str(tmp_path / "s")) as c, store.save(2) as s:
        s.put("model", os.urandom(1 << 16))
    store.close()
    assert dict(c.by_what) == PLAIN[version], dict(c.by_what)


@pytest.mark.parametrize("version", [2, 3])
def test_put_many_fsyncs_each_folder_once(tmp_path, monkeypatch, version) -> None:  # type: ignore[no-untyped-def]
    """Eight components written together: eight files (or pieces), one fsync of the save's folder."""
    store = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT, options=OpenOptions(protocol_version=version))
    with store.save(1) as s:
        s.put("x", b"x")
    items = [(f"part/{i}", os.urandom(1 << 20)) for i in range(8)]
    with counting(monkeypatch, str(tmp_path / "s")) as c, store.save(2) as s:
        got = s.put_many(items)
    assert sorted(got) == sorted(n for n, _ in items)
    folder = "saves/<save>" if version == 2 else "pieces/<save>"
    assert c.by_what[f"file {folder}"] == 8
    assert c.by_what[f"dir {folder}"] == (1 if version == 3 else 2)  # v2: saves/<save>/part/ and saves/<save>/
    ref = store.latest_complete()
    assert ref is not None and ref.step == 2
    for name, data in items:
        assert store.read(ref, name) == data
    store.close()


@pytest.mark.parametrize("version", [2, 3])
def test_put_many_failure_publishes_nothing_and_leaves_no_component(tmp_path, version) -> None:  # type: ignore[no-untyped-def]
    """One failing stream: put_many raises it, the save aborts, the others are removed."""
    store = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT, options=OpenOptions(protocol_version=version))
    with store.save(1) as s:
        s.put("x", b"x")

    def broken() -> Iterator[bytes]:
        yield os.urandom(1 << 20)
        raise RuntimeError("source failed")

    with pytest.raises(RuntimeError, match="source failed"), store.save(2) as s:
        s.put_many([("a", os.urandom(1 << 20)), ("b", broken()), ("c", os.urandom(3 << 20))])
    ref = store.latest_complete()
    assert ref is not None and ref.step == 1
    saves = tmp_path / "s" / "run" / "saves"
    assert not [p for p in saves.rglob("*") if p.is_file() and not p.parent.name.startswith("000000000001-")]
    store.close()


@pytest.mark.parametrize("version", [2, 3])
def test_put_many_past_a_settle_batch(tmp_path, monkeypatch, version) -> None:  # type: ignore[no-untyped-def]
    """More objects than one settle batch: settled in two, every component readable."""
    store = CheckpointStore.open(tmp_path / "s", "run", identity=IDENT, options=OpenOptions(protocol_version=version))
    items = [(f"c{i:02d}", os.urandom(1 << 20)) for i in range(40)]
    with store.save(1) as s:
        s.put("x", b"x")
    with counting(monkeypatch, str(tmp_path / "s")) as c, store.save(2) as s:
        s.put_many(items)
    folder = "saves/<save>" if version == 2 else "pieces/<save>"
    assert c.by_what[f"file {folder}"] == 40 and c.by_what[f"dir {folder}"] == 2
    ref = store.latest_complete()
    assert ref is not None and ref.step == 2
    assert all(store.read(ref, n) == d for n, d in items)
    store.close()


#: a restart: Checkpointer.open of an existing run for writing, then resume()
RESTART = {"file attempts": 1, "dir attempts": 1,  # the new attempt's record (fencing): its bytes, then its link
           "file events": 1}  # the resume entry's bytes (never torn); its name is not waited for


@pytest.mark.parametrize("version", [2, 3])
def test_restart_fsyncs_are_pinned_and_the_run_record_is_not_written(tmp_path, monkeypatch, version) -> None:  # type: ignore[no-untyped-def]
    """The open of an existing run reads RUN.json and writes nothing of it (no
    temporary file, no fsync, no refused link): every restart pays only the
    attempt record and the resume entry."""
    root = tmp_path / "s"
    m, o = _model()
    with Checkpointer.open(root, "run", IDENT, {"model": m, "optimizer": o}, async_save=False, handle_signals=False,
                           options=OpenOptions(protocol_version=version)) as ck:
        _train(m, o)
        ck.save(1)
    run_record = (root / "run" / "RUN.json").stat()
    created: list[str] = []
    real_open = os.open

    def spy_open(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT:
            created.append(os.path.basename(str(path)))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy_open)
    with counting(monkeypatch, str(root)) as c:
        ck = Checkpointer.open(root, "run", IDENT, {"model": m, "optimizer": o}, async_save=False,
                               handle_signals=False)
        assert ck.resume() == 2
    ck.close()
    want = dict(RESTART)
    if version == 3:  # the first save's intent, written in the background from the open (§9.3)
        want.update({"dir ": 1, "file intents": 1})  # intents/ made again (emptied by the last close)
    assert dict(c.by_what) == want, dict(c.by_what)
    assert not [n for n in created if "RUN" in n], created
    after = (root / "run" / "RUN.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (run_record.st_ino, run_record.st_mtime_ns)
