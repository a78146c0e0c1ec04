"""The one backend conformance suite, run against every backend kind."""

import os

import pytest

from ckptstore.backends.base import Backend
from ckptstore.testing import BackendConformance, RawStorage
from tests.helpers import RAW_BY_KIND

#: Servers whose conditional PUT is atomic under concurrency, so a raw-backend race may assert
#: "exactly one winner" (PROTOCOL.md §7.1). moto is not among them: its ``put_object``
#: (moto/s3/responses.py) checks ``If-None-Match: *`` with a ``get_object`` and stores the object
#: later, without a lock, in a threaded server, so two concurrent PUTs can both pass the check
#: (seen on a busy machine: two winners in one round). AWS S3 itself is atomic; moto is a test double.
ATOMIC_CREATE = ("memory", "local", "seaweedfs", "fakegcs")

# Rounds of the racing-create test. 200 rounds take ~2 s on fake-gcs-server; SeaweedFS 4.48 makes
# losing conditional PUTs wait whole seconds (1-3 s per round), so the default suite runs fewer
# rounds there; on moto (not atomic) one round checks what still holds. CKPT_RACE_ROUNDS overrides.
RACE_ROUNDS = {"memory": 20, "local": 20, "seaweedfs": 8, "fakegcs": 200, "seaweedfs-obstore": 5}


class TestBackendConformance(BackendConformance):
    @pytest.fixture
    def raw_storage(self, backend: Backend, backend_kind: str) -> RawStorage:
        return RAW_BY_KIND[backend_kind](backend)

    @pytest.fixture
    def create_is_atomic_under_races(self, backend_kind: str) -> bool:
        return backend_kind.removesuffix("-obstore") in ATOMIC_CREATE

    @pytest.fixture
    def race_rounds(self, backend_kind: str) -> int:
        return int(os.environ.get("CKPT_RACE_ROUNDS", RACE_ROUNDS.get(backend_kind, 1)))


def test_every_backend_but_the_local_disk_lists_a_content_version(backend: Backend, backend_kind: str) -> None:
    """The version test of the suite returns early where none is reported: say where that is
    allowed. The local disk's evidence is size and nanosecond mtime (PROTOCOL.md §9.2)."""
    backend.put("ver/y", [b"y"])
    (info,) = backend.list("ver/")
    assert bool(info.version) == (backend_kind != "local"), (backend_kind, info)
