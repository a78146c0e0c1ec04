"""URL schemes → backends.

Built in: a plain path or ``file://`` (local disk), ``memory://NAME``,
``s3://``, ``gs://``/``gcs://`` and ``s3+obstore://`` (S3 through obstore,
extra ``obstore``). A third-party package adds a scheme with an
entry point in the ``ckptstore.backends`` group whose value is a factory
``(url: str, storage_options: dict) -> Backend``::

    [project.entry-points."ckptstore.backends"]
    az = "mypkg.azure:backend_from_url"

or, at run time, :func:`register_scheme`. A registered scheme replaces a
built-in one of the same name, with one exception: a plain path and
``file://`` are always the built-in local disk unless :func:`register_scheme`
names ``file`` in the process itself. An installed package's entry point can
add schemes and replace the other built-in ones, but never silently take over
where a plain path writes; and opening a local store never scans the
installed distributions (12 to 25 ms of every restart's open, measured in a
fresh process: docs/performance.md). The entry points are read once per
process, at the first open of a scheme that needs them; a package installed
later in the same process is seen after a restart, or at once through
:func:`register_scheme`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any
from urllib.parse import urlparse

from ..errors import InvalidInputError
from .base import Backend

Factory = Callable[[str, dict[str, Any]], Backend]

_BUILTIN: dict[str, str] = {
    "file": "ckptstore.backends.local:backend_from_url",
    "memory": "ckptstore.backends.memory:backend_from_url",
    "s3": "ckptstore.backends.s3:backend_from_url",
    "s3+obstore": "ckptstore.backends.obstore_s3:backend_from_url",
    "gs": "ckptstore.backends.gcs:backend_from_url",
    "gcs": "ckptstore.backends.gcs:backend_from_url",
}
_registered: dict[str, Factory] = {}


def register_scheme(scheme: str, factory: Factory) -> None:
    """Make ``scheme://`` URLs open with ``factory`` in this process."""
    if not scheme.isalnum():
        raise InvalidInputError(f"URL scheme {scheme!r} must be alphanumeric")
    _registered[scheme.lower()] = factory


def _load(spec: str) -> Factory:
    module, _, attr = spec.partition(":")
    fn: Factory = getattr(importlib.import_module(module), attr)
    return fn


@cache
def _plugins() -> dict[str, EntryPoint]:
    """The installed ``ckptstore.backends`` entry points by lower-case name (read once per process)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group="ckptstore.backends"):
        found.setdefault(ep.name.lower(), ep)
    return found


#: schemes an installed entry point never replaces (see the module docstring)
_LOCAL = "file"


def _factory(scheme: str) -> Factory | None:
    if scheme in _registered:
        return _registered[scheme]
    ep = _plugins().get(scheme) if scheme != _LOCAL else None
    if ep is not None:
        fn: Factory = ep.load()
        return fn
    spec = _BUILTIN.get(scheme)
    return _load(spec) if spec else None


def known_schemes() -> list[str]:
    names = set(_BUILTIN) | set(_registered) | set(_plugins())
    return sorted(names)


def backend_from_url(url: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None) -> Backend:
    """A backend for ``url`` (a plain path means the local disk)."""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise InvalidInputError("store URL must be a non-empty string or path")
    scheme = urlparse(url).scheme.lower() if "://" in url else "file"
    factory = _factory(scheme)
    if factory is None:
        raise InvalidInputError(
            f"unknown URL scheme {scheme!r}; known: {', '.join(known_schemes())} (or a plain directory path)"
        )
    return factory(url, dict(storage_options or {}))
