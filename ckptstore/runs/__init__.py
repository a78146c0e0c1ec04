"""Deprecated alias of :mod:`ckptstore.ops` (run management moved there in 0.2.0; this path goes in 0.3.0).

Importing it warns once (a :class:`DeprecationWarning` naming the new path).
Of its modules only :mod:`ckptstore.runs.decision`, the one the documentation
named, is kept as an alias; the others were internal to the CLI and the drill.
"""

import warnings

__all__: list[str] = []

warnings.warn(
    "ckptstore.runs is deprecated and will be removed in ckptstore 0.3.0: "
    "import ckptstore.ops instead",
    DeprecationWarning,
    stacklevel=2,
)
