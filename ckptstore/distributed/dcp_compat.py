"""Deprecated alias of :mod:`ckptstore.distributed.dcp.compat` (the module moved there in 0.2.0; this path goes in 0.3.0).

Importing it warns once (a :class:`DeprecationWarning` naming the new path) and
re-exports the new module's public names: the objects are the same.
"""

import warnings

from .dcp.compat import IDENTITY, RUN_ID, PathStoreReader, PathStoreWriter

__all__ = ["IDENTITY", "RUN_ID", "PathStoreReader", "PathStoreWriter"]

warnings.warn(
    "ckptstore.distributed.dcp_compat is deprecated and will be removed in ckptstore 0.3.0: "
    "import ckptstore.distributed.dcp.compat instead",
    DeprecationWarning,
    stacklevel=2,
)
