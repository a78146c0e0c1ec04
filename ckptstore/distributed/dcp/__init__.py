"""``torch.distributed.checkpoint`` (DCP) through the store: a ``StorageWriter``
that publishes one save for all ranks (or none) and a ``StorageReader`` that
reads only verified bytes.

    from ckptstore.distributed import open_distributed
    from ckptstore.distributed.dcp import StoreReader, StoreWriter

Modules: :mod:`.writer` (``StoreWriter``), :mod:`.reader` (``StoreReader``),
:mod:`.common` (what both share), :mod:`.metadata` (DCP metadata as strict JSON),
:mod:`.compat` (path-style writer/reader for code written against DCP's
``FileSystemWriter``).
"""

from .common import DCP_VERSION, METADATA_COMPONENT, PickleRefusedError
from .compat import PathStoreReader, PathStoreWriter
from .reader import StoreReader
from .writer import StoreWriter

__all__ = [
    "DCP_VERSION", "METADATA_COMPONENT", "PathStoreReader", "PathStoreWriter", "PickleRefusedError", "StoreReader",
    "StoreWriter",
]
