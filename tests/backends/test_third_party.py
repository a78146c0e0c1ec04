"""A backend that is not ckptstore's, written here from the documentation alone
(the contract in ``ckptstore.backends.base`` and "Writing a backend" in
``ckptstore.testing``), passes the whole conformance suite through its own raw
hooks, and a store runs on it. The storage is a plain dict of bytes, so the
raw hooks are dict operations, with no knowledge of ckptstore's backends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import pytest

from ckptstore.backends import Backend, ObjectInfo
from ckptstore.backends.base import Buffer, check_depth, check_key, only_flat
from ckptstore.errors import NotFoundError
from ckptstore.testing import BackendConformance
from tests.helpers import open_reader, open_writer, save


class DictBackend(Backend):
    """Objects as ``key -> (bytes, mtime)`` in a dict shared by whoever holds it, under a lock."""

    def __init__(self, objects: dict[str, tuple[bytes, float]], lock: threading.Lock) -> None:
        self.url = "dict://test"
        self.objects = objects
        self.lock = lock

    def get(self, key: str) -> bytes:
        with self.lock:
            entry = self.objects.get(check_key(key))
        if entry is None:
            raise NotFoundError(f"{self.url}/{key}: no such object")
        return entry[0]

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get(key)[start:end]

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        data = b"".join(bytes(c) for c in chunks)  # a failing source raises before anything is stored
        with self.lock:
            self.objects[check_key(key)] = (data, time.time())

    def create(self, key: str, data: bytes) -> bool:
        with self.lock:
            if check_key(key) in self.objects:
                return False
            self.objects[key] = (bytes(data), time.time())
            return True

    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        with self.lock:
            found = sorted((k, len(v[0]), v[1]) for k, v in self.objects.items() if k.startswith(prefix))
        keys = [k for k, _, _ in found]
        if flat:
            wanted = set(only_flat(prefix, keys))
            found = [f for f in found if f[0] in wanted]
        else:
            check_depth(self.url, prefix, keys)
        return [ObjectInfo(k, size, mtime) for k, size, mtime in found]

    def size(self, key: str) -> int:
        return len(self.get(key))

    def delete(self, key: str) -> None:
        with self.lock:
            self.objects.pop(check_key(key), None)


class TestDictBackendConformance(BackendConformance):
    @pytest.fixture
    def storage(self) -> dict[str, tuple[bytes, float]]:
        return {}

    @pytest.fixture
    def backend(self, storage: dict[str, tuple[bytes, float]]) -> Backend:
        return DictBackend(storage, threading.Lock())

    def set_raw(self, backend: Backend, key: str, data: bytes) -> None:
        assert isinstance(backend, DictBackend)
        backend.objects[key] = (bytes(data), time.time())

    def get_raw(self, backend: Backend, key: str) -> bytes | None:
        assert isinstance(backend, DictBackend)
        entry = backend.objects.get(key)
        return None if entry is None else entry[0]

    def delete_raw(self, backend: Backend, key: str) -> None:
        assert isinstance(backend, DictBackend)
        backend.objects.pop(key, None)


def test_a_store_saves_and_selects_on_the_third_party_backend() -> None:
    objects: dict[str, tuple[bytes, float]] = {}
    lock = threading.Lock()
    st = open_writer(DictBackend(objects, lock))
    save(st, 1)
    ref = save(st, 2)
    again = open_reader(DictBackend(objects, lock))
    assert again.latest_complete(deep=True).save_id == ref.save_id


def test_a_suite_without_raw_hooks_says_what_to_override() -> None:
    class Bare(BackendConformance):
        pass

    with pytest.raises(NotImplementedError, match="override set_raw, get_raw and delete_raw"):
        Bare().set_raw(DictBackend({}, threading.Lock()), "k", b"v")


# ------------------------------------------------- schemes from installed packages


class _FakeEntryPoint:
    """What ``importlib.metadata`` gives for an installed ``ckptstore.backends`` entry point."""

    def __init__(self, name: str, factory: object) -> None:
        self.name = name
        self._factory = factory

    def load(self) -> object:
        return self._factory


def test_an_installed_scheme_opens_but_never_takes_over_plain_paths(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry point adds a scheme and may replace a named built-in one, but a
    plain path and ``file://`` stay the built-in local disk (an installed
    package cannot silently take over where plain paths write), and opening a
    local store never scans the installed distributions."""
    from ckptstore.backends import schemes
    from ckptstore.backends.local import LocalBackend

    taken: list[str] = []

    def hijack(url: str, opts: dict) -> Backend:
        taken.append(url)
        return DictBackend({}, threading.Lock())

    scanned: list[int] = []

    def plugins() -> dict[str, _FakeEntryPoint]:
        scanned.append(1)
        return {"file": _FakeEntryPoint("file", hijack), "dict": _FakeEntryPoint("dict", hijack)}

    monkeypatch.setattr(schemes, "_plugins", plugins)
    for url in (str(tmp_path / "a"), f"file://{tmp_path / 'b'}"):
        assert isinstance(schemes.backend_from_url(url), LocalBackend)
    assert taken == [] and scanned == []  # the local disk: no scan, no plugin
    assert isinstance(schemes.backend_from_url("dict://x/y"), DictBackend)
    assert taken == ["dict://x/y"] and scanned == [1]
    # the process itself may still replace the local disk, explicitly
    monkeypatch.setattr(schemes, "_registered", {"file": hijack})
    assert isinstance(schemes.backend_from_url(str(tmp_path / "c")), DictBackend)
