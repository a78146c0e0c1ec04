"""Map a store URL to a backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from .backends.base import Backend
from .errors import InvalidInputError

SCHEMES = ("file", "memory", "s3", "gs", "gcs")


def backend_from_url(url: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> Backend:
    """A backend for ``url``: a path, ``file://``, ``memory://NAME``,
    ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]`` or ``gcs://...``."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise InvalidInputError("store URL must be a non-empty string or path")
    if "://" not in url:
        from .backends.local import LocalBackend

        return LocalBackend(url)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "file":
        from .backends.local import LocalBackend

        if parsed.netloc not in ("", "localhost"):
            raise InvalidInputError(f"{url}: file URLs must be local (file:///path)")
        return LocalBackend(parsed.path)
    if scheme == "memory":
        from .backends.memory import named_memory_backend

        return named_memory_backend((parsed.netloc + parsed.path).strip("/"))
    if scheme in ("s3", "gs", "gcs"):
        from .backends.objectstore import object_store_backend

        return object_store_backend(url, storage_options=dict(storage_options or {}))
    raise InvalidInputError(
        f"{url}: unknown URL scheme {parsed.scheme!r}; use a path, file://, memory://, s3://, gs:// or gcs://"
    )
