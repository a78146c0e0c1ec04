"""Hostile objects planted on the local disk by someone with write access to the
store directory (protocol_spec/THREATS.md, class "planted links and special
files"): symbolic links to a directory outside the store, a symlinked run
directory, a FIFO and a link to /dev/zero as components.

Every test asserts that no byte outside the store is touched, that nothing
hangs (the CLI runs as a subprocess under a timeout) and that failures are one
line.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions
from ckptstore.backends.local import LocalBackend, NotAnObjectError, PosixOps
from ckptstore.errors import (
    CkptStoreError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    StoreUnavailableError,
)
from ckptstore.protocol import LATEST_LAYOUT
from tests.helpers import IDENT, settle_background_writes

CLI_TIMEOUT = 120
#: the tests that plant links and special files at save folders or components under saves/ use version 2's
#: layout (version 3 keeps pieces/<holder>/<blake3> instead; a link there: tests/fail_closed/test_peer_pieces.py)
V2 = OpenOptions(protocol_version=2)


def snapshot(top: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every entry under ``top`` (not following links): kind, mode, content."""
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
            out[str(p.relative_to(top))] = (kind, stat.S_IMODE(st.st_mode), data)
    return out


def outside_dir(tmp_path: Path) -> Path:
    """A directory outside the store holding files an attacker wants destroyed
    or wants weights written into; names match the components of a save."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "model").write_bytes(b"precious model file, not part of any store")
    (d / "optimizer").write_bytes(b"precious optimizer file")
    (d / "keep.txt").write_text("do not touch")
    return d


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", *args], check=False, capture_output=True, text=True, timeout=CLI_TIMEOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def assert_one_line_error(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ckptstore: ") and "Traceback" not in p.stderr


def two_saves(root: Path, options: OpenOptions | None = None) -> tuple[CheckpointStore, str, str]:
    st = CheckpointStore.open(root, "run", identity=IDENT, options=options)
    with st.save(1) as s:
        s.put("model", b"weights-1")
        s.put("optimizer", b"adam-1")
    old = st.latest_complete()
    assert old is not None
    with st.save(2) as s:
        s.put("model", b"weights-2")
        s.put("optimizer", b"adam-2")
    new = st.latest_complete()
    assert new is not None
    return st, old.save_id, new.save_id


def replace_with_link(path: Path, target: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.symlink_to(target)


# -- links: gc never deletes outside the store -----------------------------------------------------------------


def test_gc_apply_with_a_symlinked_save_directory_deletes_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    _st, old_sid, new_sid = two_saves(root, V2)
    replace_with_link(root / "run" / "saves" / old_sid, out)
    before = snapshot(out)

    p = cli("gc", str(root), "run", "--apply", "--keep-last", "1", "--grace", "0")
    assert snapshot(out) == before, p.stdout + p.stderr
    if p.returncode != 0:
        assert_one_line_error(p)
    # the newest save still verifies; the planted link itself is the only thing left of the old save
    reader = CheckpointStore.open(root, "run", mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.save_id == new_sid


def test_gc_apply_with_component_links_removes_only_the_links(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    _st, old_sid, _new_sid = two_saves(root, V2)
    for name in ("model", "optimizer"):
        replace_with_link(root / "run" / "saves" / old_sid / name, out / name)
    before = snapshot(out)

    p = cli("gc", str(root), "run", "--apply", "--keep-last", "1", "--grace", "0")
    assert snapshot(out) == before, p.stdout + p.stderr
    if p.returncode != 0:
        assert_one_line_error(p)
    assert (out / "model").read_bytes() == b"precious model file, not part of any store"


def test_symlinked_commit_record_is_not_an_object_and_gc_leaves_its_target(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    _st, _old, new_sid = two_saves(root)
    key = LATEST_LAYOUT.commit_key("run", 99, 1)  # the name a commit of step 99 would have
    planted = root.joinpath(*key.split("/"))
    planted.symlink_to(out / "keep.txt")
    before = snapshot(out)
    b = LocalBackend(root, create_root=False)
    assert key not in {o.key for o in b.list("run/commits/")}
    assert key not in b.list_keys("run/commits/")
    assert b.get_many([key], 1000) == [None]  # the batched read does not follow it either
    with pytest.raises(NotFoundError):
        b.get(key)
    p = cli("gc", str(root), "run", "--apply", "--keep-last", "1", "--grace", "0")
    assert p.returncode == 0, p.stderr
    assert snapshot(out) == before
    latest = CheckpointStore.open(root, "run", mode="r").latest_complete(deep=True)
    assert latest is not None and latest.save_id == new_sid


def test_symlinked_commits_directory_lists_nothing_and_a_writer_refuses(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, _old, _new = two_saves(root)
    commits = root / "run" / "commits"
    for f in commits.iterdir():
        (out / f.name).write_bytes(f.read_bytes())  # a plausible history the attacker points at
    replace_with_link(commits, out)
    before = snapshot(out)
    reader = CheckpointStore.open(root, "run", mode="r")
    assert reader.latest_complete() is None  # the linked history is not the store's
    assert reader.list_saves() and all(i.state.value != "committed" for i in reader.list_saves())
    linked = [f"run/commits/{f.name}" for f in out.iterdir()]
    assert linked and LocalBackend(root, create_root=False).get_many(linked, 1000) == [None] * len(linked)
    with pytest.raises(CkptStoreError), st.save(3) as s:
        s.put("model", b"weights-3")
    p = cli("gc", str(root), "run", "--apply", "--keep-last", "1", "--grace", "0")
    assert snapshot(out) == before, p.stdout + p.stderr


# -- links: a writer never writes through one ------------------------------------------------------------------


def test_writer_refuses_a_symlinked_saves_directory_and_writes_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, _old, _new = two_saves(root, V2)
    replace_with_link(root / "run" / "saves", out)
    before = snapshot(out)
    with pytest.raises(StoreUnavailableError, match="symbolic link"), st.save(3) as s:
        s.put("model", b"secret weights that must not land outside")
    assert snapshot(out) == before


def test_backend_put_and_create_through_a_link_raise_and_write_nothing_outside(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    b = LocalBackend(root)
    b.put("run/x/first", [b"1"])
    (root / "run" / "evil").symlink_to(out)
    before = snapshot(out)
    with pytest.raises(StoreUnavailableError, match="link"):
        b.put("run/evil/model", [b"weights"])
    with pytest.raises(StoreUnavailableError, match="link"):
        b.create("run/evil/new.json", b"{}")
    with pytest.raises(StoreUnavailableError, match="link"):
        b.delete("run/evil/model")
    with pytest.raises(NotFoundError):
        b.get("run/evil/model")
    with pytest.raises(NotFoundError):
        b.size("run/evil/keep.txt")
    assert [o.key for o in b.list("run/")] == ["run/x/first"]
    assert snapshot(out) == before


def test_symlinked_run_directory_is_no_run_and_is_never_written(tmp_path: Path) -> None:
    root = tmp_path / "store"
    two_saves(tmp_path / "elsewhere")[0].close()  # a version-3 writer writes its intent in the background
    real_run = tmp_path / "elsewhere" / "run"
    (root).mkdir()
    (root / "run").symlink_to(real_run)
    before = snapshot(real_run)
    with pytest.raises(NotFoundError):
        CheckpointStore.open(root, "run", mode="r")
    with pytest.raises(CkptStoreError):
        CheckpointStore.open(root, "run", identity=IDENT)
    p = cli("ls", str(root), "run")
    assert_one_line_error(p)
    p = cli("gc", str(root), "run", "--apply", "--keep-last", "1", "--grace", "0")
    assert_one_line_error(p)
    assert snapshot(real_run) == before


# -- special files: never read, never a hang ------------------------------------------------------------------


def test_fifo_component_is_skipped_by_deep_selection_without_hanging(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _st, old_sid, new_sid = two_saves(root, V2)
    comp = root / "run" / "saves" / new_sid / "model"
    comp.unlink()
    os.mkfifo(comp)
    p = cli("latest", str(root), "run", "--deep", "--json")
    assert p.returncode == 0, p.stderr
    assert f'"save_id": "{old_sid}"' in p.stdout and "missing-component" in p.stdout
    b = LocalBackend(root, create_root=False)
    with pytest.raises(NotFoundError, match="FIFO"):
        b.get(f"run/saves/{new_sid}/model")
    with pytest.raises(NotFoundError):
        b.size(f"run/saves/{new_sid}/model")
    st = CheckpointStore.open(root, "run", mode="r")
    ref = st.get_save(2)
    with pytest.raises(CorruptionError):
        st.read(ref, "model")
    p = cli("verify", str(root), "run", "--step", "2")
    assert p.returncode == 1 and "missing" in p.stdout


def test_dev_zero_link_as_a_component_is_never_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _st, old_sid, new_sid = two_saves(root, V2)
    replace_with_link(root / "run" / "saves" / new_sid / "model", Path("/dev/zero"))
    p = cli("latest", str(root), "run", "--deep", "--json")
    assert p.returncode == 0, p.stderr
    assert f'"save_id": "{old_sid}"' in p.stdout
    p = cli("ls", str(root), "run", "--deep")
    assert p.returncode == 0, p.stderr
    b = LocalBackend(root, create_root=False)
    with pytest.raises(NotFoundError, match="not an object"):
        b.get_range(f"run/saves/{new_sid}/model", 0, 1 << 30)


def test_ops_refuse_special_files_directly(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path / "store")
    b.put("k/regular", [b"x" * 100])
    os.mkfifo(tmp_path / "store" / "k" / "fifo")
    (tmp_path / "store" / "k" / "zero").symlink_to("/dev/zero")
    ops = b.ops
    assert isinstance(ops, PosixOps)
    for name in ("fifo", "zero"):
        with pytest.raises(NotAnObjectError):
            ops.read(str(tmp_path / "store" / "k" / name), 0, 10)
        with pytest.raises(NotAnObjectError):
            ops.stat(str(tmp_path / "store" / "k" / name))
    assert [o.key for o in b.list("k/")] == ["k/regular"]


def test_reads_are_bounded_by_the_request_and_the_file(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path / "store")
    b.put("k/obj", [bytes(range(100))])
    assert b.get_range("k/obj", 10, 20) == bytes(range(10, 20))
    assert b.get_range("k/obj", 90, 1 << 40) == bytes(range(90, 100))
    assert b.get_range("k/obj", 50, 40) == b""
    assert b.get("k/obj") == bytes(range(100))


# -- permissions ------------------------------------------------------------------------------------------------


def _modes(root: Path) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for dirpath, ds, fs in os.walk(root):
        dirs |= {stat.S_IMODE((Path(dirpath) / d).lstat().st_mode) for d in ds}
        files |= {stat.S_IMODE((Path(dirpath) / f).lstat().st_mode) for f in fs}
    return files, dirs


def test_created_files_and_directories_are_private_by_default(tmp_path: Path) -> None:
    old = os.umask(0)  # even with no umask at all, nothing is group- or world-accessible
    try:
        two_saves(tmp_path / "store")
    finally:
        os.umask(old)
    files, dirs = _modes(tmp_path / "store")
    assert files == {0o600} and dirs == {0o700}
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700


def test_modes_are_configurable(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        st = CheckpointStore.open(tmp_path / "a", "run", identity=IDENT,
                                  storage_options={"file_mode": "0o640", "dir_mode": 0o750})
        with st.save(1) as s:
            s.put("model", b"w")
        b = LocalBackend(tmp_path / "b", file_mode=0o644, dir_mode=0o755)
        b.put("x/y", [b"1"])
    finally:
        os.umask(old)
    assert _modes(tmp_path / "a") == ({0o640}, {0o750})
    assert _modes(tmp_path / "b") == ({0o644}, {0o755})
    with pytest.raises(InvalidInputError, match="file_mode"):
        LocalBackend(tmp_path / "c", file_mode=0o4777)
    with pytest.raises(InvalidInputError) as ei:
        CheckpointStore.open(tmp_path / "d", "run", identity=IDENT, storage_options={"secret_key": "hunter2"})
    assert "secret_key" in str(ei.value) and "hunter2" not in str(ei.value)


@pytest.mark.parametrize("swap", ["fifo", "symlink"])
def test_an_entry_swapped_after_the_check_is_refused_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str
) -> None:
    """The race an lstat-then-open check alone would lose: the regular file is
    replaced between the check and the open. O_NOFOLLOW | O_NONBLOCK and the
    fstat comparison refuse it, and nothing blocks."""
    import threading

    b = LocalBackend(tmp_path / "store")
    b.put("k/obj", [b"x" * 10])
    target = tmp_path / "store" / "k" / "obj"
    real_open = os.open

    def swapping_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "obj" and kwargs.get("dir_fd") is not None and not flags & (os.O_WRONLY | os.O_DIRECTORY):
            target.unlink()
            if swap == "fifo":
                os.mkfifo(target)
            else:
                target.symlink_to("/dev/zero")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapping_open)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(b.get("k/obj"))
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            outcome.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the read blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], NotFoundError), outcome


def test_gc_of_a_partial_save_holding_links_deletes_only_its_regular_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    out = outside_dir(tmp_path)
    st, _old, _new = two_saves(root, V2)
    w = st.save(3)  # a killed writer: components, no commit
    w.put("model", b"weights-3")
    partial = next(p for p in (root / "run" / "saves").iterdir() if p.name.startswith("000000000003-"))
    (partial / "escape").symlink_to(out)
    (partial / "optimizer").symlink_to(out / "optimizer")
    os.link(out / "keep.txt", partial / "hard")  # a hard link to an outside file
    before = snapshot(out)
    p = cli("gc", str(root), "run", "--apply", "--keep-last", "1", "--grace", "0")
    assert p.returncode == 0, p.stderr
    assert snapshot(out) == before
    assert not (partial / "model").exists()
    assert (out / "keep.txt").read_text() == "do not touch"
