"""Lightning ``CheckpointIO`` plug-ins backed by a :class:`~ckptstore.CheckpointStore`.

    from ckptstore.integrations.lightning import StoreCheckpointIO, AsyncStoreCheckpointIO
    trainer = Trainer(plugins=[StoreCheckpointIO(url, run_id, identity=identity)])

Modules: :mod:`.checkpoint_io` (``StoreCheckpointIO``, ``load_module``),
:mod:`.async_io` (``AsyncStoreCheckpointIO``), :mod:`.files` (how a Lightning
checkpoint becomes components and a pointer file), :mod:`.paths` (its
checkpoint directories: no link followed below them), :mod:`.trust` (reading a
pointer file as hostile input).
"""

from .async_io import AsyncStoreCheckpointIO
from .checkpoint_io import StoreCheckpointIO, load_module
from .files import DOC_COMPONENT, FORMAT, POINTER_FORMAT, write_pointer_for_latest
from .trust import RemovalRefusedWarning, read_pointer

__all__ = [
    "DOC_COMPONENT",
    "FORMAT",
    "POINTER_FORMAT",
    "AsyncStoreCheckpointIO",
    "RemovalRefusedWarning",
    "StoreCheckpointIO",
    "load_module",
    "read_pointer",
    "write_pointer_for_latest",
]
