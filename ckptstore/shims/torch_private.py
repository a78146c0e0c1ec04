"""PyTorch's private APIs that ckptstore relies on (tested: torch 2.4 to 2.13).

* DCP's stream-transform machinery (``_extension``, ``_StorageWriterTransforms``,
  ``_StorageReaderTransforms``): the project's DCP writer and reader accept
  the same ``_extensions`` as ``FileSystemWriter``/``FileSystemReader``.
* ``narrow_tensor_by_index`` (``torch.distributed._shard._utils``): the same
  narrowing DCP's own reader applies to a requested slice.
* c10d's default store (``distributed_c10d._get_default_store``): the
  rendezvous store the coordination channel posts to, so a job needs no
  second rendezvous.
* a ``DataLoader``'s ``_get_iterator`` (torch and torchdata's
  ``StatefulDataLoader``): the one moment at which a restored loader applies
  its state, hooked once after a resume.
* ``torch.utils.data.dataloader._MultiProcessingDataLoaderIter``: the class of
  a DataLoader iterator that feeds worker processes, recognised on the call
  stack of a sampler's first draw (:func:`feeding_worker_processes`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
    from torch.distributed.checkpoint.filesystem import (
        _StorageReaderTransforms as StorageReaderTransforms,
    )
    from torch.distributed.checkpoint.filesystem import (
        _StorageWriterTransforms as StorageWriterTransforms,
    )

# DCP's names are imported on first use (module ``__getattr__``): importing
# torch.distributed.checkpoint pulls in DTensor and sympy (0.6 s here), which a
# process that only uses ckptstore.torch (a restart) should not pay.
_LAZY = {
    "narrow_tensor_by_index": ("torch.distributed._shard._utils", "narrow_tensor_by_index"),
    "ExtensionRegistry": ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
    "StreamTransformExtension": ("torch.distributed.checkpoint._extension", "StreamTransformExtension"),
    "StorageReaderTransforms": ("torch.distributed.checkpoint.filesystem", "_StorageReaderTransforms"),
    "StorageWriterTransforms": ("torch.distributed.checkpoint.filesystem", "_StorageWriterTransforms"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

#: the torch releases these names were tested with (the extra ``torch`` says ``>=2.4,<3``)
TESTED = ">=2.4,<3"

__all__ = [
    "TESTED",
    "ExtensionRegistry",
    "StorageReaderTransforms",
    "StorageWriterTransforms",
    "StreamTransformExtension",
    "default_store",
    "feeding_worker_processes",
    "hook_next_iterator",
    "narrow_tensor_by_index",
]


def default_store() -> Any:
    """The default process group's rendezvous store (c10d's ``_get_default_store``)."""
    return dist.distributed_c10d._get_default_store()


def hook_next_iterator(loader: Any, wrap: Callable[[Callable[[], Any]], Any]) -> None:
    """Call ``wrap(original)`` instead of ``loader._get_iterator()`` the next
    time the loader builds an iterator, once: the instance attribute is removed
    before ``wrap`` runs, so later iterators come from the class method again."""
    original: Callable[[], Any] = loader._get_iterator

    def once() -> Any:
        del loader._get_iterator
        return wrap(original)

    loader._get_iterator = once


def feeding_worker_processes(depth: int = 6) -> bool:
    """Whether the caller (a sampler's ``__iter__`` at its first draw) is being read by a
    DataLoader iterator that hands indices to worker processes: such an iterator is
    ``self`` of one of the next ``depth`` calling frames (torch's ``_next_index`` reads
    the sampler through the batch sampler)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(depth):
            if f is None:
                return False
            f = f.f_back
            if f is not None and isinstance(f.f_locals.get("self"), _MultiProcessingDataLoaderIter):
                return True
        return False
    finally:
        del frame
