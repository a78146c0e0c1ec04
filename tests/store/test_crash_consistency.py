"""Crash consistency, enumerated: every I/O boundary of a save, and every state a
power loss may leave on the local disk.

After every crash: no commit record exists without all its bytes (invariant 1,
checked raw through the backend: the selection below would quietly skip such a
commit); what is selected verifies byte for byte; the store is entirely before
the save (the previous save selected) or entirely after it (the new save
selected); an acknowledged save is never lost.
"""

from __future__ import annotations

import os

import pytest

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.backends.faults import Crashed, FaultyBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.testing.invariants import assert_invariant_1, invariant_1_violations
from ckptstore.testing.simfs import SimFS
from tests.helpers import IDENT, settle_background_writes

SHAPES = {1: [3000], 2: [100, 20_000], 3: [0, 5000, 70_000]}  # component sizes per shape

# these tests plant into version 2's layout: whole components under saves/ (version 3's planted pieces:
# tests/incremental, tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)

# totals are collected for the closing report: pytest -s prints them
COVERED: dict[str, int] = {}


def payload(step: int, i: int, size: int) -> bytes:
    seed = f"{step}.{i}.".encode()
    return (seed * (size // len(seed) + 1))[:size]


def do_save(store: CheckpointStore, step: int, sizes: list[int], many: bool = False) -> None:
    """``many``: the components in one ``put_many`` (fsynced together, one folder fsync: PROTOCOL.md §7.2)."""
    with store.save(step) as s:
        if many:
            s.put_many([(f"part{i}", payload(step, i, size)) for i, size in enumerate(sizes)])
            return
        for i, size in enumerate(sizes):
            s.put(f"part{i}", payload(step, i, size))


def check_before_or_after(reader: CheckpointStore, sizes: list[int], acked: bool, context: str) -> str:
    latest = reader.latest_complete(deep=True)
    assert latest is not None, f"previous save lost: {context}"
    if latest.step == 2:
        for i, size in enumerate(sizes):
            assert reader.read(latest, f"part{i}") == payload(2, i, size), context
        return "after"
    assert not acked, f"acknowledged save lost: {context}"
    assert latest.step == 1 and reader.read(latest, "part0") == payload(1, 0, 100), context
    return "before"


# ---------------------------------------------------------------- backend ops


def test_crash_at_every_backend_operation(backend_factory, backend_kind) -> None:  # type: ignore[no-untyped-def]
    crash_at_every_operation(backend_factory, backend_kind, 2)


@pytest.mark.backends("memory", "local")
@pytest.mark.parametrize("k", [1, 3])
def test_crash_at_every_backend_operation_more_shapes(backend_factory, backend_kind, k) -> None:  # type: ignore[no-untyped-def]
    crash_at_every_operation(backend_factory, backend_kind, k)


def crash_at_every_operation(backend_factory, backend_kind, k) -> None:  # type: ignore[no-untyped-def]
    sizes = SHAPES[k]
    inner = backend_factory()
    # count the operations of one save on a throwaway run
    probe = FaultyBackend(inner)
    # version 2: a save's operations, counted on a first save, are those of the next one; version 3's are not
    # (its second save lists the pieces it reuses, and its intent is written by a background thread)
    st = CheckpointStore.open(probe, "probe", identity=IDENT, options=V2)
    start = probe.count
    do_save(st, 1, sizes)
    n_ops = probe.count - start
    outcomes = {"before": 0, "after": 0}
    for n in range(1, n_ops + 2):
        run = f"r{n}"
        fb = FaultyBackend(inner)
        st = CheckpointStore.open(fb, run, identity=IDENT, options=V2)
        do_save(st, 1, [100])
        fb.crash_at(fb.count + n)
        acked = False
        try:
            do_save(st, 2, sizes)
            acked = True
        except Crashed:
            pass
        assert_invariant_1(inner, run, f"crash at op {n}\n{fb.format_trace()}")
        reader = CheckpointStore.open(inner, run, mode="r")
        outcomes[check_before_or_after(reader, sizes, acked, f"crash at op {n}\n{fb.format_trace()}")] += 1
    assert outcomes["before"] >= 1 and outcomes["after"] >= 1
    COVERED[f"ops/{backend_kind}/k={k}"] = n_ops + 1


# ---------------------------------------------------------------- power loss


def power_loss_matrix(k: int, tmp_path, make_backend=LocalBackend, many: bool = False,  # type: ignore[no-untyped-def]
                      version: int = 2):
    """Crash at every syscall of a save; for each, every allowed loss of un-synced state.
    ``many``: the save writes its components with one ``put_many``; ``version`` 3: as pieces,
    with a save intent (created lazily, §7.2) and a ledger-free save."""
    sizes = SHAPES[k]
    root = str(tmp_path / "store")
    base = SimFS(root)
    opts = OpenOptions(protocol_version=version)
    st = CheckpointStore.open(make_backend(root, ops=base), "run", identity=IDENT, options=opts)
    do_save(st, 1, [100])
    st.close()  # joins the version-3 intent write
    base.sync_all()
    probe = base.clone()
    start = probe.ops
    st = CheckpointStore.open(make_backend(root, ops=probe), "run", identity=IDENT)
    do_save(st, 2, sizes, many)
    st.close()
    n_calls = probe.ops - start
    states = 0
    failures = []
    for n in range(1, n_calls + 2):
        fs = base.clone()
        writer = CheckpointStore.open(make_backend(root, ops=fs), "run", identity=IDENT)
        fs.sync_all()  # the attempt registration happened before the window
        fs.crash_after(n)
        acked = False
        try:
            do_save(writer, 2, sizes, many)
            acked = True
            writer.close()  # the intent write after the commit, and its removal, inside the window
        except Crashed:
            pass
        for desc, after in fs.crash_states(limit=256, seed=n):
            states += 1
            after_backend = LocalBackend(root, ops=after, create_root=False)
            for bad in invariant_1_violations(after_backend, "run"):
                failures.append(f"syscall {n} ({fs.log[-1]}): {desc}: invariant 1: {bad}")
            reader = CheckpointStore.open(after_backend, "run", mode="r")
            try:
                check_before_or_after(reader, sizes, acked, f"power loss at syscall {n}: {desc}")
            except AssertionError as exc:
                failures.append(f"syscall {n} ({fs.log[-1]}): {desc}: {str(exc).splitlines()[0]}")
    return n_calls, states, failures


@pytest.mark.parametrize("k", sorted(SHAPES))
def test_power_loss_at_every_syscall_local(tmp_path, k) -> None:  # type: ignore[no-untyped-def]
    n_calls, states, failures = power_loss_matrix(k, tmp_path)
    assert not failures, "\n".join(failures[:10])
    assert states > n_calls
    COVERED[f"power-loss/local/k={k}"] = states


# version 3: the intent write that follows the commit, in its background thread, meets the simulated power loss
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(("k", "version"), [(2, 2), (3, 2), (2, 3), (3, 3)])
def test_power_loss_at_every_syscall_local_put_many(tmp_path, k, version) -> None:  # type: ignore[no-untyped-def]
    """The batched durability of PROTOCOL.md §7.2: every file fsynced, renamed, each folder
    fsynced once, before the entries exist; version 3 also with the lazily created intent."""
    n_calls, states, failures = power_loss_matrix(k, tmp_path, many=True, version=version)
    assert not failures, "\n".join(failures[:10])
    assert states > n_calls
    COVERED[f"power-loss/local/put_many/v{version}/k={k}"] = states


class NoDirFsyncOnCreate(LocalBackend):
    """A deliberately broken backend: forgets the directory fsync after linking a commit."""

    def create(self, key: str, data: bytes) -> bool:
        real = self.ops.fsync_dir
        self.ops.fsync_dir = lambda path: None  # type: ignore[method-assign]
        try:
            return super().create(key, data)
        finally:
            self.ops.fsync_dir = real  # type: ignore[method-assign]


class RenameCommit(LocalBackend):
    """A deliberately broken backend: publishes the commit with rename (no exclusivity)
    and skips the temp file's fsync."""

    def create(self, key: str, data: bytes) -> bool:
        final = self._path(key)
        self._makedirs(os.path.dirname(final))
        fd = self.ops.open_new(final + ".tmp-x")
        self.ops.write(fd, data)
        self.ops.close(fd)
        self.ops.rename(final + ".tmp-x", final)
        self.ops.fsync_dir(os.path.dirname(final))
        return True


@pytest.mark.parametrize("broken", [NoDirFsyncOnCreate, RenameCommit])
def test_power_loss_suite_catches_a_broken_commit_order(tmp_path, broken) -> None:  # type: ignore[no-untyped-def]
    _, _, failures = power_loss_matrix(2, tmp_path, make_backend=broken)
    assert failures, f"{broken.__name__} was not caught"


def test_stray_temp_files_are_not_objects(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "s")
    fs = SimFS(root)
    st = CheckpointStore.open(LocalBackend(root, ops=fs), "run", identity=IDENT)
    do_save(st, 1, [100])
    # a version-3 save writes its next intent in a background thread after it returned: wait for it, so
    # that the crash below counts the second save's syscalls alone (it used to land in that thread at times)
    settle_background_writes()
    fs.sync_all()
    fs.crash_after(3)  # dies three syscalls into the second save, before anything of it is complete
    with pytest.raises(Crashed):
        do_save(st, 2, [5000])
    reader = CheckpointStore.open(LocalBackend(root, ops=fs, create_root=False), "run", mode="r")
    assert [i.step for i in reader.list_saves()] == [1]


def test_gc_removes_stray_temporaries_after_the_grace_period(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import time as _t

    root = tmp_path / "s"
    st = CheckpointStore.open(str(root), "run", identity=IDENT, options=V2)
    do_save(st, 1, [100])
    save_dir = next((root / "run" / "saves").iterdir())
    stray = save_dir / f".part9{'.ckpt-tmp-'}abc123"
    stray.write_bytes(b"half a component")
    assert st.gc(keep_last=1, grace_seconds=3600).temporaries == []  # young: may be in flight
    old = _t.time() - 7200
    os.utime(stray, (old, old))
    rep = st.gc(keep_last=1, grace_seconds=3600, dry_run=True)
    assert rep.temporaries and stray.exists()
    st.gc(keep_last=1, grace_seconds=3600)
    assert not stray.exists()
    assert CheckpointStore.open(str(root), "run", mode="r").latest_complete(deep=True).step == 1


def test_ls_shows_leftovers_and_latest_names_its_check(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import time as _t

    from ckptstore.cli.commands import main as cli_main

    root = tmp_path / "s"
    st = CheckpointStore.open(str(root), "run", identity=IDENT, options=V2)
    do_save(st, 1, [100])
    save_dir = next((root / "run" / "saves").iterdir())
    young = save_dir / ".a.ckpt-tmp-111111"
    old = save_dir / ".b.ckpt-tmp-222222"
    young.write_bytes(b"x")
    old.write_bytes(b"y")
    past = _t.time() - 7200
    os.utime(old, (past, past))
    assert cli_main(["ls", str(root), "run"]) == 0
    out = capsys.readouterr().out
    assert "1 older than the grace period" in out and "1 younger" in out
    assert cli_main(["latest", str(root), "run"]) == 0
    assert "--deep" in capsys.readouterr().out
    assert cli_main(["latest", str(root), "run", "--deep"]) == 0
    assert "every byte re-hashed" in capsys.readouterr().out
    assert cli_main(["gc", str(root), "run", "--apply"]) == 0
    assert young.exists() and not old.exists()
