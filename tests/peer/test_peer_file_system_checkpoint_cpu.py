"""PyTorch's own DCP file-system test-suite, unchanged, run against the store.

The upstream file (``upstream/test_file_system_checkpoint_cpu.py``, see
``PROVENANCE.md``) is executed in this module's namespace after
``torch.distributed.checkpoint.FileSystemWriter`` / ``FileSystemReader`` (and
the copies ``dcp.save(checkpoint_id=path)`` uses) were replaced by
:class:`~ckptstore.distributed.dcp.compat.PathStoreWriter` /
``PathStoreReader``. The suite's rank processes are spawned and re-import
this module, so the swap happens in every process before the test code runs.

``CKPT_PEER_BASELINE=1`` runs the same file without the swap (DCP's own
classes), to compare pass/skip sets.
"""

from __future__ import annotations

import importlib.util
import os
import unittest
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint import _storage_utils

from ckptstore.distributed.dcp.compat import PathStoreReader, PathStoreWriter

UPSTREAM = Path(__file__).with_name("upstream") / "test_file_system_checkpoint_cpu.py"
BASELINE = os.environ.get("CKPT_PEER_BASELINE") == "1"


class PeerReader(PathStoreReader):
    """The reader as a user constructs it by default (no ``allow_pickle``): the suite's Python values
    (BYTE_IO items, ``torch.save``d by DCP's planner) load under torch's restricted unpickler."""

    def __init__(self, path: Any, _extension_registry: Any = None) -> None:
        super().__init__(path, _extension_registry)


if not BASELINE:
    _dcp.FileSystemWriter = PathStoreWriter  # type: ignore[misc]
    _dcp.FileSystemReader = PeerReader  # type: ignore[misc]
    _storage_utils.FileSystemWriter = PathStoreWriter  # type: ignore[attr-defined]
    _storage_utils.FileSystemReader = PeerReader  # type: ignore[attr-defined]

if not UPSTREAM.exists():
    pytest.skip(f"{UPSTREAM} is not present (see tests/peer/PROVENANCE.md)", allow_module_level=True)

exec(compile(UPSTREAM.read_text(), str(UPSTREAM), "exec"), globals())  # noqa: S102 - the vendored suite, unchanged

# Tests that cannot run here whatever the storage (same reasons with CKPT_PEER_BASELINE=1):
_SKIPS: list[tuple[str, str, str]] = [
    ("TestDistributedStateDictSaveLoad", "test_dtype_mismatch_casting",
     "uses DefaultLoadPlanner(allow_unsafe_types=...), which torch 2.13 does not have (newer upstream test)"),
]
if importlib.util.find_spec("zstandard") is None and importlib.util.find_spec("pyzstd") is None:
    _SKIPS.append(("TestDistributedStateDictSaveLoadZStandard", "test_read_write_only_tensor",
                   "the ZStandard extension needs the zstandard or pyzstd package, not installed"))
if not torch.cuda.is_available():
    _SKIPS.append(("TestDistributedReshardOnLoad", "test_load_rowwise_to_colwise", "moves models to CUDA"))



def _apply_skips() -> None:
    # a function, so no loop variable holding a TestCase class is left in the
    # module namespace (pytest would collect it a second time)
    for cls_name, prefix, why in _SKIPS:
        cls = globals()[cls_name]
        for name in list(vars(cls)):
            if name.startswith(prefix):
                setattr(cls, name, unittest.skip(why)(getattr(cls, name)))


_apply_skips()


def test_the_swap_is_in_place() -> None:
    """The names the suite uses are the store's classes in this process (the
    spawned ranks run this same module first)."""
    if BASELINE:
        pytest.skip("baseline run: DCP's own classes")
    assert _dcp.FileSystemWriter is PathStoreWriter and _storage_utils.FileSystemWriter is PathStoreWriter
    assert _dcp.FileSystemReader is PeerReader and _storage_utils.FileSystemReader is PeerReader
    assert globals()["FileSystemWriter"] is PathStoreWriter  # bound by the upstream file's own import
