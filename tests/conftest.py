"""Backend fixtures shared by every suite.

``backend_kind`` is parametrized over every backend the run covers: memory and
local always; the object-store servers (SeaweedFS, moto, fake-gcs-server) are
added by ``tests/servers.py`` (session-scoped, started here, stopped after).
Set ``CKPT_BACKENDS=memory,local`` to narrow a local run; CI runs them all.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend
from ckptstore.backends.memory import MemoryBackend, clear_memory_registry

ALL_KINDS = ["memory", "local", "seaweedfs", "moto", "fakegcs"]
OBJECT_KINDS = {"seaweedfs", "moto", "fakegcs"}


def selected_kinds() -> list[str]:
    env = os.environ.get("CKPT_BACKENDS")
    if not env:
        return ALL_KINDS
    kinds = [k.strip() for k in env.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ALL_KINDS + ["external-s3", "external-gcs"]]
    if bad:
        raise pytest.UsageError(f"CKPT_BACKENDS names unknown backends {bad}; known: {ALL_KINDS}")
    return kinds


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_kind" in metafunc.fixturenames:
        kinds = selected_kinds()
        only = getattr(metafunc.cls, "backend_kinds", None) or getattr(metafunc.module, "backend_kinds", None)
        if only is not None:
            kinds = [k for k in kinds if k in only]
        metafunc.parametrize("backend_kind", kinds, scope="function")


@pytest.fixture(autouse=True)
def _clear_memory_registry() -> Iterator[None]:
    clear_memory_registry()
    yield
    clear_memory_registry()


@pytest.fixture
def backend_factory(backend_kind: str, tmp_path, request) -> Iterator[Callable[[], Backend]]:  # type: ignore[no-untyped-def]
    """A callable returning a *new* backend object on this test's fresh location
    (memory: the same instance, since memory is per instance)."""
    made: list[Backend] = []
    if backend_kind == "memory":
        mem = MemoryBackend("test")

        def factory() -> Backend:
            return mem

    elif backend_kind == "local":

        def factory() -> Backend:
            b = LocalBackend(tmp_path / "store")
            return b

    else:
        servers = request.getfixturevalue("object_servers")
        prefix = f"t-{uuid.uuid4().hex[:12]}"

        def factory() -> Backend:
            b = servers.backend(backend_kind, prefix)
            made.append(b)
            return b

    yield factory
    for b in made:
        b.close()


@pytest.fixture
def backend(backend_factory: Callable[[], Backend]) -> Backend:
    return backend_factory()
