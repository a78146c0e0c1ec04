"""What many test modules share: the run identity, a save of deterministic
blobs, opening a store for writing and for reading, a tiny torch model, and
direct access to the storage under a built-in backend.

Test modules import from here (``from tests.helpers import IDENT, save``);
worker scripts (tests/workers/) run as separate processes and keep their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.fsspec_base import FsspecBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend
from ckptstore.backends.obstore_s3 import ObstoreS3Backend
from ckptstore.protocol.selection import SaveRef
from ckptstore.testing.raw import FsspecRaw, LocalRaw, MemoryRaw, ObstoreRaw, RawStorage

if TYPE_CHECKING:
    import torch

#: The run identity of the tests that do not test identities themselves.
IDENT: dict[str, Any] = {
    "data_digest": "data-47",
    "code_digest": "code-82",
    "optimizer_revision": "adam-r3",
    "feature_contract": "receipt-v4",
    "world_size": 1,
}


def blob(step: int, name: str, size: int = 3000) -> bytes:
    """``size`` bytes that differ by step and component name."""
    seed = f"{step}:{name}:".encode()
    return (seed * (size // len(seed) + 1))[:size]


def save(store: CheckpointStore, step: int, names: Sequence[str] = ("model", "optim"), size: int = 3000) -> SaveRef:
    """Commit a save of ``step`` with one :func:`blob` per name; its reference."""
    with store.save(step) as s:
        for n in names:
            s.put(n, blob(step, n, size))
    assert s.ref is not None
    return s.ref


def open_writer(backend: Backend | str, run: str = "run", identity: dict[str, Any] | None = None,
                **keywords: Any) -> CheckpointStore:
    """A store open for writing with :data:`IDENT` (or ``identity``)."""
    return CheckpointStore.open(backend, run, identity=IDENT if identity is None else identity, **keywords)


def open_reader(backend: Backend | str, run: str = "run", **keywords: Any) -> CheckpointStore:
    """A store open read-only (registers nothing)."""
    return CheckpointStore.open(backend, run, mode="r", **keywords)


def tiny_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 4->3 linear layer and its AdamW optimizer, seeded."""
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Linear(4, 3)
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)


#: Direct storage access per backend kind of tests/conftest.py (the fixture knows the kind it made).
RAW_BY_KIND: dict[str, Callable[[Any], RawStorage]] = {
    "memory": MemoryRaw,
    "local": LocalRaw,
    "seaweedfs": FsspecRaw,
    "moto": FsspecRaw,
    "fakegcs": FsspecRaw,
    "external-s3": FsspecRaw,
    "external-gcs": FsspecRaw,
    "seaweedfs-obstore": ObstoreRaw,
    "moto-obstore": ObstoreRaw,
}

_RAW_BY_TYPE: tuple[tuple[type[Backend], Callable[[Any], RawStorage]], ...] = (
    (MemoryBackend, MemoryRaw),
    (LocalBackend, LocalRaw),
    (FsspecBackend, FsspecRaw),
    (ObstoreS3Backend, ObstoreRaw),
)


def RawAccess(backend: Backend) -> RawStorage:
    """Direct access to the storage under one of ckptstore's own backends,
    for tests that hold a backend object rather than a kind."""
    for cls, raw in _RAW_BY_TYPE:
        if isinstance(backend, cls):
            return raw(backend)
    raise TypeError(f"no raw access for {type(backend).__name__}")


#: The threads alive when the running test began (the autouse fixture in conftest.py sets it):
#: another test's background writes (one may retry a server that test stopped, for minutes) are
#: not the running test's.
THREADS_BEFORE_TEST: set[threading.Thread] = set()


def settle_background_writes() -> None:
    """Wait for the background writes the running test's saves started: a
    version-3 save writes its next save intent in a thread after it returns
    (PROTOCOL.md §9.4), so a test that compares snapshots of the storage waits
    for those first (threads named ``ckptstore-intent`` started in this test)."""
    for t in threading.enumerate():
        if t.name == "ckptstore-intent" and t not in THREADS_BEFORE_TEST:
            t.join()
