"""Deprecated alias of :mod:`ckptstore.backends.faults` (the module moved there in 0.2.0; this path goes in 0.3.0).

Importing it warns once (a :class:`DeprecationWarning` naming the new path) and
re-exports the new module's public names: the objects are the same.
"""

import warnings

from .backends.faults import Crashed, Fault, FaultyBackend, TraceEntry, transient

__all__ = ["Crashed", "Fault", "FaultyBackend", "TraceEntry", "transient"]

warnings.warn(
    "ckptstore.faults is deprecated and will be removed in ckptstore 0.3.0: "
    "import ckptstore.backends.faults instead",
    DeprecationWarning,
    stacklevel=2,
)
