"""Direct access to a backend's storage, bypassing the backend's own methods
(the zarr ``StoreTests`` idea): tests plant objects with it and check what
the backend really stored. One implementation per backend family."""

from __future__ import annotations

import os

from ..backends.base import Backend
from ..backends.fsspec_base import FsspecBackend
from ..backends.local import LocalBackend
from ..backends.memory import MemoryBackend
from ..backends.obstore_s3 import ObstoreS3Backend


def _obstore_path(b: ObstoreS3Backend, key: str) -> str:
    return f"{b.prefix}/{key}" if b.prefix else key


class RawAccess:
    """``set``/``get``/``delete`` of a key straight on the storage under a backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def set(self, key: str, data: bytes) -> None:
        b = self.backend
        if isinstance(b, MemoryBackend):
            b.plant(key, data)
        elif isinstance(b, LocalBackend):
            path = os.path.join(b.root, *key.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        elif isinstance(b, FsspecBackend):
            b.fs.pipe_file(f"{b.root}/{key}", bytes(data))
            b.fs.invalidate_cache()
        elif isinstance(b, ObstoreS3Backend):
            import obstore

            obstore.put(b.store, _obstore_path(b, key), bytes(data), use_multipart=False)
        else:
            raise TypeError(f"no raw access for {type(b).__name__}")

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None if nothing is stored at ``key``."""
        b = self.backend
        try:
            if isinstance(b, MemoryBackend):
                return b.stored(key)
            if isinstance(b, LocalBackend):
                with open(os.path.join(b.root, *key.split("/")), "rb") as f:
                    return f.read()
            if isinstance(b, FsspecBackend):
                b.fs.invalidate_cache()
                return bytes(b.fs.cat_file(f"{b.root}/{key}"))
            if isinstance(b, ObstoreS3Backend):
                import obstore

                return bytes(obstore.get(b.store, _obstore_path(b, key)).bytes())
        except (KeyError, FileNotFoundError):
            return None
        raise TypeError(f"no raw access for {type(b).__name__}")

    def delete(self, key: str) -> None:
        b = self.backend
        if isinstance(b, MemoryBackend):
            b.unplant(key)
        elif isinstance(b, LocalBackend):
            try:
                os.unlink(os.path.join(b.root, *key.split("/")))
            except FileNotFoundError:
                pass
        elif isinstance(b, FsspecBackend):
            try:
                b.fs.rm_file(f"{b.root}/{key}")
            except FileNotFoundError:
                pass
            b.fs.invalidate_cache()
        elif isinstance(b, ObstoreS3Backend):
            import obstore

            obstore.delete(b.store, _obstore_path(b, key))
        else:
            raise TypeError(f"no raw access for {type(b).__name__}")
