"""Drop-ins for DCP's ``FileSystemWriter`` / ``FileSystemReader`` that keep a
*path* interface but store through ckptstore.

    from ckptstore.distributed.dcp.compat import PathStoreWriter, PathStoreReader
    dcp.save(state, storage_writer=PathStoreWriter("/ckpt/dir"))
    dcp.load(state, storage_reader=PathStoreReader("/ckpt/dir", allow_pickle=True))

The path (or ``s3://`` / ``gs://`` URL) holds one run, ``dcp``, under a fixed
identity; each ``dcp.save`` is one published save (step = the latest step + 1,
attempt registered by the coordinator, joined by the other ranks); each load
reads the newest complete save. This exists for code written against the
FileSystem classes (and to run PyTorch's own test-suite against the store);
new code should use :func:`open_distributed` with :class:`StoreWriter`.

Constructor arguments of the FileSystem classes that do not apply
(``single_file_per_rank``, ``sync_files``, ``per_thread_copy_ahead``,
``cache_staged_state_dict``, ``overwrite``, ``serialization_format``) are
accepted and ignored: the store always fsyncs, writes one component per rank
and thread, and never overwrites a save.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...errors import InvalidInputError
from ...options import OpenOptions
from ...shims.torch_private import ExtensionRegistry, StorageReaderTransforms, StorageWriterTransforms, StreamTransformExtension
from ...store import CheckpointStore
from .common import SavePlanData
from .reader import StoreReader
from .writer import StoreWriter

__all__ = ["IDENTITY", "RUN_ID", "PathStoreReader", "PathStoreWriter"]

RUN_ID = "dcp"
IDENTITY: Mapping[str, Any] = {"format": "ckptstore.dcp-path/1"}


@dataclasses.dataclass(frozen=True)
class _PathPlanData:
    save_id: str
    attempt: int


class PathStoreWriter(StoreWriter):
    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        serialization_format: Any = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        # StoreWriter.__init__ needs a store; ours is opened per save (coordinator) or joined (members).
        self.path = path
        self.storage_options = storage_options
        self.thread_count = max(1, int(thread_count))
        self.metadata = {}

        self.transforms = StorageWriterTransforms(_extensions)
        self._has_transforms = bool(_extensions)
        self.rank = 0
        self.is_coordinator = True
        self.ref = None
        self._staged = None
        self._save_id = None
        self.step = None
        self._store: CheckpointStore | None = None

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            raise InvalidInputError("PathStoreWriter: no save in progress")
        return self._store

    @store.setter
    def store(self, value: CheckpointStore) -> None:
        self._store = value

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = checkpoint_id
        self.ref = None
        self._staged = None
        self._save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not kwargs.get("use_collectives", True):
            raise InvalidInputError("PathStoreWriter needs collectives (one commit for all ranks)")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        store = CheckpointStore.open(
            self.path, RUN_ID, identity=IDENTITY, storage_options=self.storage_options,
            options=OpenOptions(resume_verify="cheap", single_writer=True),
        )
        assert store.attempt is not None
        self._store = store
        self.step = store.resumed_from.step + 1 if store.resumed_from is not None else 0
        sid = store.new_save_id(self.step)
        return [dataclasses.replace(p, storage_data=_PathPlanData(sid, store.attempt.number)) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data: _PathPlanData = plan.storage_data
        if self._store is None or self._store.attempt is None or self._store.attempt.number != data.attempt:
            self._store = CheckpointStore.open(
                self.path, RUN_ID, identity=IDENTITY, storage_options=self.storage_options, join_attempt=data.attempt
            )
        from ...protocol import parse_save_id

        sa = parse_save_id(data.save_id)
        assert sa is not None
        self.step = sa[0]
        return super().write_data(dataclasses.replace(plan, storage_data=_plan_data(data)), planner)


def _plan_data(data: _PathPlanData) -> Any:
    return SavePlanData(data.save_id)


class PathStoreReader(StoreReader):
    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: ExtensionRegistry | None = None,
        *,
        allow_pickle: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.coalesce_bytes = 64 << 20

        self.transforms = StorageReaderTransforms(_extension_registry)
        self._step = None
        self._items = {}
        self.ref = None
        self._store: CheckpointStore | None = None
        self.target = None  # type: ignore[assignment]

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            self._store = CheckpointStore.open(self.path, RUN_ID, mode="r", storage_options=self.storage_options)
        return self._store

    @store.setter
    def store(self, value: CheckpointStore) -> None:
        self._store = value

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = checkpoint_id
            self._store = None
        self.ref = None
        self._items = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.ref = None  # the newest complete save, each load
        return super().read_metadata(*args, **kwargs)
