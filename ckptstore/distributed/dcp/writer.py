"""The DCP ``StorageWriter`` backed by a CheckpointStore (package docs: :mod:`ckptstore.distributed.dcp`).

    import torch.distributed.checkpoint as dcp
    from ckptstore.distributed import open_distributed
    from ckptstore.distributed.dcp import StoreReader, StoreWriter

    run = open_distributed(url, "run-7", identity=identity)        # every rank
    dcp.save(state, storage_writer=StoreWriter(run, step=100))     # hashed, atomic, all ranks or none
    dcp.load(state, storage_reader=StoreReader(run))               # the save this attempt resumed from
    fut = dcp.async_save(state, storage_writer=StoreWriter(run, step=200))

How a save goes:

* ``prepare_global_plan`` (coordinator) chooses the save ID and hands it to
  every rank inside its plan.
* ``write_data`` (every rank) writes one component per rank and I/O thread
  (``dcp/rank00001-0.bin``), never one per tensor, through ``store.stage``:
  the component is hashed with BLAKE3 while it is written, and every item in
  it gets its own (offset, length, BLAKE3) so a reader can verify exactly the
  byte ranges it reads. Tensors are stored as raw bytes (dtype and chunk shape
  in the metadata); nothing is pickled by this layer.
* ``finish`` (coordinator) writes the metadata as JSON (``dcp/metadata.json``,
  see :mod:`.metadata`) and publishes the save from the gathered write
  results: one listing checks every component, the commit record is created
  exclusively and lists each rank's components and the world size. If any
  rank failed, DCP never calls ``finish``: nothing is published.

Loading reshards through DCP's planners (save on N ranks, load on M). A
BYTE_IO item (a non-tensor object) was pickled by DCP's planner when it was
saved; by default the reader loads it only with torch's restricted
``weights_only`` unpickler (primitives, containers, tensors) and refuses any
other object with :class:`PickleRefusedError`; ``allow_pickle=True``
unpickles in full, for checkpoints you trust.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ... import StagedSave
from ... import protocol as P
from ...errors import InvalidInputError
from ...protocol.selection import SaveRef
from ...shims.torch_private import StorageWriterTransforms, StreamTransformExtension
from ...store import CheckpointStore
from ..coordinator import DistributedRun
from ..errors import may_delete_after
from .common import DCP_VERSION, METADATA_COMPONENT, SavePlanData, step_of, store_of
from .metadata import ItemInfo, StorageData, dtype_name, encode_metadata

_COMPONENT_FQN = "\x00ckptstore-component"


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


class StoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that publishes each ``dcp.save`` as one save of the store.

    ``target``: the :class:`DistributedRun` of this rank (from
    :func:`open_distributed`) or, for a single process, a writable
    :class:`CheckpointStore`. ``step``: the step of the next save (or pass
    ``checkpoint_id=step`` to ``dcp.save``). ``thread_count``: I/O threads, one
    component per thread and rank. ``metadata``: JSON object for the commit
    record. After the save, ``writer.ref`` (coordinator) is the published save.
    """

    def __init__(
        self,
        target: DistributedRun | CheckpointStore,
        step: int | None = None,
        *,
        thread_count: int = 1,
        metadata: Mapping[str, Any] | None = None,
        _extensions: Sequence[StreamTransformExtension] | None = None,
    ) -> None:
        super().__init__()
        self.store = store_of(target)
        if self.store.mode != "w":
            raise InvalidInputError("StoreWriter needs a store opened for writing")
        if self.store.options.tiers is not None and self.store.options.tiers.rank is not None:
            # DCP publishes on the coordinator alone: the other ranks never learn the record, so their parts
            # would never be committed locally nor replicated (docs/tiers.md "Many ranks")
            raise InvalidInputError("the DCP StoreWriter on a two-tier job of many ranks (open_distributed(..., "
                                    "options=OpenOptions(tiers=...))) is not supported yet: DCP publishes on the "
                                    "coordinator alone, so the other ranks' parts would never be committed in their "
                                    "local tiers nor replicated; open the job without tiers, or save per rank with "
                                    "Checkpointer(RankStore(run))")
        self.step = None if step is None else P.validate_step(step)
        self.thread_count = max(1, int(thread_count))
        self.metadata = dict(metadata or {})
        self.transforms = StorageWriterTransforms(_extensions)
        self._has_transforms = bool(_extensions)
        self.rank = 0
        self.is_coordinator = True
        self.ref: SaveRef | None = None
        self._staged: StagedSave | None = None
        self._save_id: str | None = None

    # ------------------------------------------------------------ lifecycle
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = step_of(checkpoint_id)
        if step is not None:
            self.step = step
        self.ref = None
        self._staged = None
        self._save_id = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else (0 if is_coordinator else self.rank)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step), save_id=self._save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            return step_of(checkpoint_id) is not None
        except InvalidInputError:
            return False

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.step is None:
            raise InvalidInputError("StoreWriter needs a step: StoreWriter(run, step=N) or dcp.save(..., checkpoint_id=N)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self.step is not None
        sid = self.store.new_save_id(self.step)
        return [dataclasses.replace(p, storage_data=SavePlanData(sid)) for p in plans]

    # --------------------------------------------------------------- write
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.step is not None
        data: SavePlanData = plan.storage_data
        self._save_id = data.save_id
        staged = self.store.stage(self.step, save_id=data.save_id)
        self._staged = staged
        buckets = _split(self.thread_count, plan.items)
        results: list[WriteResult] = []
        try:
            if len(buckets) == 1:
                results = self._write_component(staged, planner, 0, buckets[0])
            else:
                with ThreadPoolExecutor(max_workers=len(buckets), thread_name_prefix="ckptstore-dcp") as pool:
                    futs = [pool.submit(self._write_component, staged, planner, i, b) for i, b in enumerate(buckets)]
                    for f in futs:
                        results.extend(f.result())
        except BaseException:
            staged.abort()
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_component(
        self, staged: StagedSave, planner: SavePlanner, k: int, items: list[WriteItem]
    ) -> list[WriteResult]:
        if not items:
            return []
        name = f"dcp/rank{self.rank:05d}-{k}.bin"
        results: list[WriteResult] = []
        lock = threading.Lock()

        def chunks() -> Iterator[memoryview | bytes]:
            offset = 0
            # BYTE_IO first (small), then tensors, as DCP's own writer does
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                obj = planner.resolve_data(item)
                dtype: str | None = None
                shape: tuple[int, ...] | None = None
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(obj, io.BytesIO):
                        raise InvalidInputError(f"{item.index.fqn}: BYTE_IO data must be io.BytesIO")
                    raw: memoryview | bytes = obj.getbuffer()
                else:
                    if not isinstance(obj, torch.Tensor):
                        raise InvalidInputError(f"{item.index.fqn}: expected a tensor")
                    if obj.layout != torch.strided or obj.is_quantized:
                        raise InvalidInputError(f"{item.index.fqn}: only dense tensors can be saved")
                    raw = _tensor_bytes(obj)
                    dtype = dtype_name(obj.dtype)
                    shape = tuple(obj.shape)
                descriptors: tuple[str, ...] = ()
                if self._has_transforms:
                    sink = io.BytesIO()
                    stream, desc = self.transforms.transform_save_stream(item, sink)
                    stream.write(raw)
                    stream.close()
                    raw = sink.getvalue()
                    descriptors = tuple(desc)
                digest = blake3.blake3(raw, max_threads=blake3.blake3.AUTO if len(raw) > (1 << 22) else 1).hexdigest()
                info = ItemInfo(name, offset, len(raw), digest, dtype, shape, descriptors)
                with lock:
                    results.append(WriteResult(index=item.index, size_in_bytes=len(raw), storage_data=info))
                offset += len(raw)
                if len(raw):
                    yield raw

        entry = staged.put(name, chunks())
        results.append(WriteResult(index=MetadataIndex(_COMPONENT_FQN + "/" + name), size_in_bytes=entry.size,
                                   storage_data=entry))
        return results

    # -------------------------------------------------------------- finish
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.step is not None and self._save_id is not None and self._staged is not None
        staged = self._staged
        try:
            items: dict[MetadataIndex, ItemInfo] = {}
            comps: dict[str, P.ComponentEntry] = {}
            ranks: dict[int, list[str]] = {}
            for r, wrs in enumerate(results):
                for wr in wrs:
                    if isinstance(wr.storage_data, P.ComponentEntry):
                        comps[wr.storage_data.name] = wr.storage_data
                        ranks.setdefault(r, []).append(wr.storage_data.name)
                    else:
                        items[wr.index] = wr.storage_data
            metadata.version = DCP_VERSION
            metadata.storage_meta = self.storage_meta()
            md_entry = staged.put(METADATA_COMPONENT, encode_metadata(metadata, items))
            comps[md_entry.name] = md_entry
            ranks.setdefault(self.rank, []).append(md_entry.name)
            user_md = {**self.metadata, "format": "ckptstore.dcp/1"}
            self.ref = self.store.publish(self.step, self._save_id, comps, metadata=user_md,
                                         ranks=ranks, world_size=len(results))
            metadata.storage_data = StorageData(items, self.ref.to_json())
        except BaseException as exc:
            if may_delete_after(exc):
                staged.abort()
            raise


def _split(bins: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Balance items over ``bins`` components by size (largest first)."""
    if bins <= 1 or len(items) <= 1:
        return [list(items)]

    def size(wi: WriteItem) -> int:
        if wi.type == WriteItemType.BYTE_IO or wi.tensor_data is None:
            return 0
        n = 1
        for s in wi.tensor_data.size:
            n *= s
        return n * wi.tensor_data.properties.dtype.itemsize

    buckets: list[list[WriteItem]] = [[] for _ in range(min(bins, len(items)))]
    sizes = [0] * len(buckets)
    for wi in sorted(items, key=size, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(wi)
        sizes[i] += size(wi)
    return [b for b in buckets if b]

__all__ = ["StoreWriter"]
