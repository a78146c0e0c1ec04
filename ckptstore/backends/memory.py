"""In-memory backend: a dict under a lock, per instance.

``memory://NAME`` URLs resolve to a process-wide registry of named instances
(so two ``CheckpointStore.open`` calls see the same data); ``MemoryBackend()``
created directly is private to its holder. Used by tests and for dry runs;
nothing survives the process.
"""

from __future__ import annotations

import builtins
import itertools
import threading
import time
from collections.abc import Iterable

from ..errors import NotFoundError
from .base import Backend, Buffer, Capabilities, ObjectInfo, check_depth, only_flat


class MemoryBackend(Backend):
    capabilities = Capabilities(atomic_create=True, consistent_list=True)

    def __init__(self, name: str = "") -> None:
        self.url = f"memory://{name}"
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, float, int]] = {}
        #: the version of every write (ObjectInfo.version): no two writes share one
        self._writes = itertools.count(1)

    # ground truth for the conformance suite: bytes as stored, no backend logic
    def plant(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` directly, as someone with access to the storage would."""
        with self._lock:
            self._objects[key] = (bytes(data), time.time(), next(self._writes))

    def stored(self, key: str) -> bytes | None:
        """The bytes stored at ``key``, or None."""
        with self._lock:
            entry = self._objects.get(key)
        return None if entry is None else entry[0]

    def unplant(self, key: str) -> None:
        """Remove whatever is stored at ``key`` (nothing if absent)."""
        with self._lock:
            self._objects.pop(key, None)

    def get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self._objects[key][0]
            except KeyError:
                raise NotFoundError(f"{self.url}/{key}: no such object") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get(key)[start:end]

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        data = b"".join(bytes(c) for c in chunks)
        with self._lock:
            self._objects[key] = (data, time.time(), next(self._writes))

    def create(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = (bytes(data), time.time(), next(self._writes))
            return True

    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        with self._lock:
            found = [(k, v) for k, v in sorted(self._objects.items()) if k.startswith(prefix)]
        keys = [k for k, _ in found]
        if flat:
            keep = set(only_flat(prefix, keys))
            found = [(k, v) for k, v in found if k in keep]
        else:
            check_depth(self.url, prefix, keys)
        return [ObjectInfo(k, len(v[0]), v[1], str(v[2])) for k, v in found]

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> builtins.list[str]:
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix) and k > start_after)
        if flat:
            keys = only_flat(prefix, keys)
        else:
            check_depth(self.url, prefix, keys)
        return keys if limit is None else keys[: max(0, limit)]

    def size(self, key: str) -> int:
        return len(self.get(key))

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)


_REGISTRY: dict[str, MemoryBackend] = {}
_REGISTRY_LOCK = threading.Lock()


def named_memory_backend(name: str) -> MemoryBackend:
    with _REGISTRY_LOCK:
        b = _REGISTRY.get(name)
        if b is None:
            b = _REGISTRY[name] = MemoryBackend(name)
        return b


def clear_memory_registry() -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.clear()


def backend_from_url(url: str, storage_options: dict[str, object]) -> MemoryBackend:
    """``memory://NAME``: one backend per name in this process."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    return named_memory_backend((parsed.netloc + parsed.path).strip("/"))
