"""Storage backends: the :class:`Backend` interface, the built-in backends and
the URL-scheme registry.

    from ckptstore.backends import Backend, LocalBackend, MemoryBackend, register_scheme

``s3://`` and ``gs://`` backends (:mod:`.s3`, :mod:`.gcs`, :mod:`.obstore_s3`)
import their client library when they are opened, so they are not imported
here; :mod:`.faults` wraps any backend with injected faults (tests, drills).
A third-party backend proves itself with the conformance suite of the test kit.
"""

from .base import Backend, Capabilities, ObjectInfo
from .local import LocalBackend
from .memory import MemoryBackend
from .schemes import backend_from_url, register_scheme

__all__ = ["Backend", "Capabilities", "LocalBackend", "MemoryBackend", "ObjectInfo", "backend_from_url",
           "register_scheme"]
