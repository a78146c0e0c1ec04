"""Deferred puts on the local disk (``put_deferred`` + ``settle``, how pieces are
written): after a power loss at any system call, or any loss of unsynced
state, every key holds its complete object or nothing — never a torn one —
and once ``settle`` returned every object survives any power loss."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptstore.backends.faults import Crashed
from ckptstore.backends.local import LocalBackend
from ckptstore.testing.simfs import SimFS

OBJECTS = {f"run/pieces/000000000001-00000001-ab/{i:064x}": bytes([i + 1]) * (1000 + i) for i in range(3)}


def deferred_save(backend: LocalBackend) -> None:
    pending = [backend.put_deferred(k, [v[:500], v[500:]]) for k, v in OBJECTS.items()]
    backend.settle(pending)


def complete_or_absent(fs: SimFS, root: str, context: str) -> int:
    """How many objects are there (each checked whole)."""
    reader = LocalBackend(root, ops=fs, create_root=False)
    there = {o.key: o.size for o in reader.list("run/")}
    for k, v in OBJECTS.items():
        if k in there:
            assert reader.get(k) == v, f"torn object {k[-8:]} after {context}"
    assert set(there) <= set(OBJECTS), context
    return len(there)


def test_a_power_loss_anywhere_leaves_no_torn_object(tmp_path: Path) -> None:
    root = str(tmp_path)
    n = 1
    finished = False
    while not finished:
        fs = SimFS(root)
        fs.crash_after(n)
        try:
            deferred_save(LocalBackend(root, ops=fs))
            finished = True
        except Crashed:
            pass
        for what, state in fs.crash_states(limit=64):
            got = complete_or_absent(state, root, f"crash at call {n} ({what})")
            if finished:
                assert got == len(OBJECTS), f"a settled object was lost: {what}"
        n += 1
    assert n > 10  # the loop really went through every call of the save


def test_settle_without_fsyncs_would_be_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above has teeth: a settle that skips the file fsyncs leaves a torn object."""
    root = str(tmp_path)
    fs = SimFS(root)
    monkeypatch.setattr(fs, "fsync", lambda fd: None)
    deferred_save(LocalBackend(root, ops=fs))
    with pytest.raises(AssertionError, match="torn object|settled object was lost"):
        for what, state in fs.crash_states(limit=256):
            assert complete_or_absent(state, root, what) == len(OBJECTS), "a settled object was lost"
