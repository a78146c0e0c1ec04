"""Direct access to the storage under a built-in backend, bypassing the
backend's own methods (the zarr ``StoreTests`` idea): tests plant objects with
it and check what the backend really stored.

One class per built-in backend family, each taking that backend: the caller
(a test fixture, which knows which backend it made) picks the class, so
nothing here guesses a backend's type. A third-party backend does not need
these: its conformance subclass overrides
:meth:`~ckptstore.testing.conformance.BackendConformance.set_raw`,
``get_raw`` and ``delete_raw`` instead (see :mod:`ckptstore.testing`).
"""

from __future__ import annotations

import os
from typing import Protocol

from ..backends.fsspec_base import FsspecBackend
from ..backends.local import LocalBackend
from ..backends.memory import MemoryBackend
from ..backends.obstore_s3 import ObstoreS3Backend


class RawStorage(Protocol):
    """``set``/``get``/``delete`` of a key straight on the storage under one backend."""

    def set(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` as someone with access to the storage would (replacing)."""

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None if nothing is stored at ``key``."""

    def delete(self, key: str) -> None:
        """Remove whatever is stored at ``key`` (nothing if absent)."""


class MemoryRaw:
    """The dict under a :class:`~ckptstore.backends.memory.MemoryBackend`."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend

    def set(self, key: str, data: bytes) -> None:
        self.backend.plant(key, data)

    def get(self, key: str) -> bytes | None:
        return self.backend.stored(key)

    def delete(self, key: str) -> None:
        self.backend.unplant(key)


class LocalRaw:
    """The files under a :class:`~ckptstore.backends.local.LocalBackend`'s root, by plain ``open``."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend

    def _path(self, key: str) -> str:
        return os.path.join(self.backend.root, *key.split("/"))

    def set(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass


class FsspecRaw:
    """The objects under an fsspec backend (``s3://`` through s3fs, ``gs://`` through gcsfs), by its filesystem."""

    def __init__(self, backend: FsspecBackend) -> None:
        self.backend = backend

    def set(self, key: str, data: bytes) -> None:
        b = self.backend
        b.fs.pipe_file(f"{b.root}/{key}", bytes(data))
        b.fs.invalidate_cache()

    def get(self, key: str) -> bytes | None:
        b = self.backend
        b.fs.invalidate_cache()
        try:
            return bytes(b.fs.cat_file(f"{b.root}/{key}"))
        except (KeyError, FileNotFoundError):
            return None

    def delete(self, key: str) -> None:
        b = self.backend
        try:
            b.fs.rm_file(f"{b.root}/{key}")
        except FileNotFoundError:
            pass
        b.fs.invalidate_cache()


class ObstoreRaw:
    """The objects under an ``s3+obstore://`` backend, by obstore's own calls."""

    def __init__(self, backend: ObstoreS3Backend) -> None:
        self.backend = backend

    def _path(self, key: str) -> str:
        b = self.backend
        return f"{b.prefix}/{key}" if b.prefix else key

    def set(self, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.backend.store, self._path(key), bytes(data), use_multipart=False)

    def get(self, key: str) -> bytes | None:
        import obstore

        try:
            return bytes(obstore.get(self.backend.store, self._path(key)).bytes())
        except (KeyError, FileNotFoundError):
            return None

    def delete(self, key: str) -> None:
        import obstore

        obstore.delete(self.backend.store, self._path(key))
