"""Deprecated alias of :mod:`ckptstore.integrations.lightning.async_io` (the module moved there in 0.2.0; this path goes in 0.3.0).

Importing it warns once (a :class:`DeprecationWarning` naming the new path) and
re-exports the new module's public names: the objects are the same.
"""

import warnings

from .lightning.async_io import AsyncStoreCheckpointIO

__all__ = ["AsyncStoreCheckpointIO"]

warnings.warn(
    "ckptstore.integrations.lightning_async is deprecated and will be removed in ckptstore 0.3.0: "
    "import ckptstore.integrations.lightning.async_io instead",
    DeprecationWarning,
    stacklevel=2,
)
