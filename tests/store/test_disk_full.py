"""A full local disk: ENOSPC in the middle of a component, in the commit record,
and in the attempt registration.

The fault is injected at the system-call layer (``PosixOps.write``, the seam
the local backend already offers for power-loss simulation): the write that
crosses the byte budget stores the bytes that still fit, then fails with
``ENOSPC`` exactly like a full filesystem does. (A size-limited tmpfs would
need ``mount``, which CI may not allow; this runs anywhere.)

After each: a clean error (StoreUnavailableError naming the lack of space),
the previous save still selected and byte-exact, no commit of the failed save,
no temporary files left, and the failed save's bytes removed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from ckptstore import CheckpointStore, StoreUnavailableError
from ckptstore.backends.base import Buffer
from ckptstore.backends.local import LocalBackend, PosixOps
from ckptstore.testing.invariants import assert_invariant_1, commits_of_step, save_objects
from tests.helpers import IDENT

SIZES = {"model": 30_000, "optim": 50_000}


class FullDisk(PosixOps):
    """A filesystem with ``free`` bytes left (None: unlimited)."""

    def __init__(self) -> None:
        self.free: int | None = None
        self.hits = 0

    def write(self, fd: int, buf: Buffer) -> None:
        view = memoryview(buf).cast("B")
        if self.free is not None and len(view) > self.free:
            fits = self.free
            super().write(fd, view[:fits])
            self.free = 0
            self.hits += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self.free is not None:
            self.free -= len(view)
        super().write(fd, view)

    def unlink(self, path: str) -> None:
        if self.free is not None:
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is not None and st.st_nlink == 1:  # the last name: its blocks come back
                self.free += st.st_size
        super().unlink(path)


def blob(step: int, name: str) -> bytes:
    seed = f"<{step}/{name}>".encode()
    return (seed * (SIZES[name] // len(seed) + 1))[: SIZES[name]]


def save(store: CheckpointStore, step: int) -> None:
    with store.save(step) as s:
        for name in SIZES:
            s.put(name, blob(step, name))


def temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".ckpt-tmp-" in p.name]


def check_previous_selected(root: Path) -> None:
    reader = CheckpointStore.open(LocalBackend(root, create_root=False), "run", mode="r")
    latest = reader.latest_complete(deep=True)
    assert latest is not None and latest.step == 1
    for name in SIZES:
        assert reader.read(latest, name) == blob(1, name)


@pytest.fixture
def disk(tmp_path: Path) -> tuple[Path, FullDisk, CheckpointStore]:
    root = tmp_path / "store"
    ops = FullDisk()
    store = CheckpointStore.open(LocalBackend(root, ops=ops), "run", identity=IDENT)
    save(store, 1)
    return root, ops, store


def test_disk_full_in_the_middle_of_a_component(disk: tuple[Path, FullDisk, CheckpointStore]) -> None:
    root, ops, store = disk
    ops.free = SIZES["model"] + SIZES["optim"] // 2  # the second component runs out half-way
    with pytest.raises(StoreUnavailableError, match="no space left"):
        save(store, 2)
    assert ops.hits == 1
    backend = LocalBackend(root, create_root=False)
    assert commits_of_step(backend, "run", 2) == []
    assert_invariant_1(backend, "run", "ENOSPC mid-component")
    check_previous_selected(root)
    assert temporaries(root) == [], "the half-written temporary file was left behind"
    assert [s for s in save_objects(backend, "run") if s.startswith("000000000002-")] == [], (
        "the failed save's first component was left behind"
    )
    ops.free = None  # space freed: the next save works
    save(store, 2)
    assert CheckpointStore.open(backend, "run", mode="r").latest_complete(deep=True).step == 2  # type: ignore[union-attr]


def test_disk_full_in_the_attempt_registration(tmp_path: Path) -> None:
    root = tmp_path / "store"
    ops = FullDisk()
    save(CheckpointStore.open(LocalBackend(root, ops=ops), "run", identity=IDENT), 1)
    ops.free = 10
    with pytest.raises(StoreUnavailableError, match="no space left"):
        CheckpointStore.open(LocalBackend(root, ops=ops), "run", identity=IDENT)
    assert temporaries(root) == []
    check_previous_selected(root)
    ops.free = None
    again = CheckpointStore.open(LocalBackend(root, ops=ops), "run", identity=IDENT)
    assert again.resumed_from is not None and again.resumed_from.step == 1


def test_disk_full_in_the_commit_record(disk: tuple[Path, FullDisk, CheckpointStore]) -> None:
    root, ops, store = disk
    ops.free = sum(SIZES.values()) + 20  # the components fit, the commit record does not
    with pytest.raises(StoreUnavailableError, match="no space left"):
        save(store, 2)
    assert ops.hits == 1
    backend = LocalBackend(root, create_root=False)
    assert commits_of_step(backend, "run", 2) == []
    assert_invariant_1(backend, "run", "ENOSPC in the commit")
    check_previous_selected(root)
    assert temporaries(root) == [], "the commit record's temporary file was left behind"
    ops.free = None
    save(store, 2)
    assert CheckpointStore.open(backend, "run", mode="r").latest_complete(deep=True).step == 2  # type: ignore[union-attr]


def test_disk_full_in_the_commit_record_removes_the_save(disk: tuple[Path, FullDisk, CheckpointStore]) -> None:
    """The failed save's components must not keep the disk full."""
    root, ops, store = disk
    ops.free = sum(SIZES.values()) + 20
    with pytest.raises(StoreUnavailableError):
        save(store, 2)
    left = [s for s in save_objects(LocalBackend(root, create_root=False), "run") if s.startswith("000000000002-")]
    assert left == [], f"the failed save's components stay on the full disk until a gc: {left}"
