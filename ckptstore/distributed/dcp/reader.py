"""The DCP ``StorageReader`` of :mod:`ckptstore.distributed.dcp.writer` (see there)."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any

import blake3
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...errors import CorruptionError, NotFoundError
from ...protocol.selection import SaveRef
from ...shims.torch_private import ExtensionRegistry, StorageReaderTransforms, narrow_tensor_by_index
from ...store import CheckpointStore
from ..coordinator import DistributedRun
from .common import METADATA_COMPONENT, PickleRefusedError, step_of, store_of
from .metadata import MAX_METADATA_BYTES, ItemInfo, StorageData, decode_metadata, dtype_from_name
from .writer import StoreWriter

#: the most bytes a BYTE_IO item (a pickled object) may decompress to
MAX_BYTES_ITEM = 256 << 20


def restricted_bytes(fqn: str, data: bytes) -> bytes:
    """A BYTE_IO item (``torch.save`` of a non-tensor value, DCP's default planner) made safe to hand to
    the planner, which unpickles it in full: the value is loaded with torch's restricted ``weights_only``
    unpickler (primitives, containers, tensors, and what ``torch.serialization.add_safe_globals`` allows;
    no other global is resolved, so no other code runs) and saved again, so what the planner unpickles
    is this process's own encoding of a vetted value. Anything else is a :class:`PickleRefusedError`."""
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        why = next((ln.strip() for ln in first if "Unsupported" in ln or "GLOBAL" in ln), first[0] if first else "")
        raise PickleRefusedError(
            f"item {fqn!r} is a pickled Python object that torch's restricted weights_only unpickler refuses "
            f"({why[:200]}); unpickling it in full runs arbitrary code. Pass allow_pickle=True to the reader only "
            "for checkpoints you trust, allow its classes with torch.serialization.add_safe_globals, or keep "
            "such objects out of the DCP state dict (store their state_dict() instead)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a damaged torch.save archive fails however its reader says so
        raise CorruptionError(f"item {fqn!r}: its bytes are not a torch.save archive "
                              f"({type(exc).__name__}: {str(exc)[:160]})") from None
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


class StoreReader(StorageReader):
    """A DCP ``StorageReader`` reading one committed save of the store.

    Which save: ``ref`` if given; else ``checkpoint_id=step`` passed to
    ``dcp.load`` (the highest committed attempt of that step); else, with a
    :class:`DistributedRun`, the save this attempt resumed from (the same on
    every rank); else ``latest_complete()``. Every byte range read is checked
    against its item's BLAKE3 digest. BYTE_IO items (non-tensor values, which
    DCP's default planner stores with ``torch.save``) are loaded with torch's
    restricted ``weights_only`` unpickler by default (primitives, containers,
    tensors: see :func:`restricted_bytes`) and any other object is refused
    with :class:`PickleRefusedError`; ``allow_pickle=True`` unpickles them in
    full, for checkpoints you trust.
    """

    def __init__(
        self,
        target: DistributedRun | CheckpointStore,
        ref: SaveRef | None = None,
        *,
        allow_pickle: bool = False,
        coalesce_bytes: int = 64 << 20,
        _extension_registry: ExtensionRegistry | None = None,
    ) -> None:
        super().__init__()
        self.target = target
        self.store = store_of(target)
        self.ref = ref
        self.allow_pickle = allow_pickle
        self.coalesce_bytes = coalesce_bytes
        self.transforms = StorageReaderTransforms(_extension_registry)
        self._step: int | None = None
        self._items: dict[MetadataIndex, ItemInfo] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = step_of(checkpoint_id)
        if step is not None:
            self._step = step
            self.ref = None
        self._items = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return StoreWriter.validate_checkpoint_id(checkpoint_id)

    def _resolve(self) -> SaveRef:
        if self.ref is not None:
            return self.ref
        if self._step is not None:
            ref = self.store.get_save(self._step)
        elif isinstance(self.target, DistributedRun) and self.target.resumed_from is not None:
            ref = self.target.resumed_from
        else:
            latest = self.store.latest_complete()
            if latest is None:
                raise NotFoundError(f"run {self.store.run_id!r} has no complete save to load")
            ref = latest
        self.ref = ref
        return ref

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NotFoundError("ckptstore saves have one global metadata document, no per-rank metadata")
        ref = self._resolve()
        if METADATA_COMPONENT not in ref.components:
            raise NotFoundError(f"save {ref.save_id} (step {ref.step}) was not written by the DCP StoreWriter")
        where = f"{ref.save_id}/{METADATA_COMPONENT}"
        claimed = ref.components[METADATA_COMPONENT].size
        if claimed > MAX_METADATA_BYTES:
            raise CorruptionError(f"{where}: the commit claims {claimed} bytes of DCP metadata, more than the "
                                  f"{MAX_METADATA_BYTES} this reader accepts")
        md, items = decode_metadata(self.store.read(ref, METADATA_COMPONENT), where)
        self._check_items(ref, items, where)
        md.storage_data = StorageData(items, ref.to_json())
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        return md

    def _check_items(self, ref: SaveRef, items: dict[MetadataIndex, ItemInfo], where: str) -> None:
        """Every item lies inside a component of this save and names only
        transforms this reader knows (refused before any data is read)."""
        known: set[tuple[str, ...]] = set()
        for idx, info in items.items():
            at = f"{where}: DCP metadata field items[{idx.fqn!r}, offset {list(idx.offset or []) or None}]"
            comp = ref.components.get(info.component)
            if comp is None:
                raise CorruptionError(f"{at}.component names {info.component[:120]!r}, which the save does not have")
            if info.offset + info.length > comp.size:
                raise CorruptionError(f"{at}: bytes [{info.offset}, {info.offset + info.length}) lie outside "
                                      f"{info.component!r} ({comp.size} bytes)")
            if info.transforms and info.transforms not in known:
                try:
                    self.transforms.extension_registry.from_descriptor_list(info.transforms)
                except Exception as exc:  # noqa: BLE001 - an extension's own refusal, whatever its type
                    raise CorruptionError(
                        f"{at}.transforms: {list(info.transforms)!r} cannot be undone by this reader "
                        f"({type(exc).__name__}: {str(exc)[:160]}); register the extension with "
                        "_extension_registry= if it is genuine"
                    ) from None
                known.add(info.transforms)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        sd = metadata.storage_data
        if not isinstance(sd, StorageData):
            raise CorruptionError("DCP metadata was not produced by StoreReader.read_metadata")
        self._items = sd.items
        ref = self._resolve()
        if ref.manifest_digest != sd.ref["manifest_digest"]:
            # another rank resolved another save: read the one the metadata belongs to
            ref = self.store.get_save(int(sd.ref["step"]), int(sd.ref["attempt"]))
            if ref.manifest_digest != sd.ref["manifest_digest"]:
                raise CorruptionError(f"save {sd.ref['save_id']} changed while it was being loaded")
            self.ref = ref

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ref = self._resolve()
        per_comp: dict[str, list[tuple[ItemInfo, ReadItem]]] = {}
        for req in plan.items:
            info = self._items.get(req.storage_index)
            if info is None:
                raise CorruptionError(f"save {ref.save_id}: no stored item for {req.storage_index}")
            if info.component not in ref.components:
                raise CorruptionError(f"save {ref.save_id}: item {req.storage_index.fqn} names a missing component")
            per_comp.setdefault(info.component, []).append((info, req))
        for comp, reqs in per_comp.items():
            reqs.sort(key=lambda x: x[0].offset)
            for group in self._coalesce(reqs):
                start = group[0][0].offset
                end = max(i.offset + i.length for i, _ in group)
                blob = self.store.read_range(ref, comp, start, end)
                if len(blob) != end - start:
                    raise CorruptionError(f"{comp}: short read [{start}, {end}) of save {ref.save_id}")
                view = memoryview(blob)
                for info, req in group:
                    raw = view[info.offset - start : info.offset - start + info.length]
                    if blake3.blake3(raw).hexdigest() != info.blake3:
                        raise CorruptionError(
                            f"save {ref.save_id}: item {req.storage_index.fqn} (bytes {info.offset}+{info.length} "
                            f"of {comp}) does not match its BLAKE3 digest"
                        )
                    self._load_item(info, req, raw, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _coalesce(self, reqs: list[tuple[ItemInfo, ReadItem]]) -> list[list[tuple[ItemInfo, ReadItem]]]:
        groups: list[list[tuple[ItemInfo, ReadItem]]] = []
        for info, req in reqs:
            if groups:
                g = groups[-1]
                g_start = g[0][0].offset
                g_end = max(i.offset + i.length for i, _ in g)
                if info.offset <= g_end + 4096 and info.offset + info.length - g_start <= self.coalesce_bytes:
                    g.append((info, req))
                    continue
            groups.append([(info, req)])
        return groups

    def _untransform(self, info: ItemInfo, req: ReadItem, raw: memoryview, limit: int) -> bytes:
        """The item's bytes with its stream transforms undone, reading at most
        ``limit + 1`` of them: a stream that decompresses past its declared
        size is refused, never inflated."""
        fqn = req.storage_index.fqn
        try:
            stream = self.transforms.transform_load_stream(req, info.transforms, io.BytesIO(bytes(raw)))
            out = bytearray()
            while len(out) <= limit:
                block = stream.read(min(1 << 20, limit + 1 - len(out)))
                if not block:
                    break
                out += block
        except Exception as exc:  # noqa: BLE001 - a damaged stream fails however its decoder says so
            raise CorruptionError(f"item {fqn!r}: its stream transforms {list(info.transforms)!r} fail on the "
                                  f"stored bytes ({type(exc).__name__}: {str(exc)[:160]})") from None
        if len(out) > limit:
            raise CorruptionError(f"item {fqn!r}: its transformed stream {list(info.transforms)!r} holds more than "
                                  f"the {limit} bytes its metadata declares")
        return bytes(out)

    def _load_item(self, info: ItemInfo, req: ReadItem, raw: memoryview, planner: LoadPlanner) -> None:
        data: bytes | memoryview = raw
        if req.type == LoadItemType.BYTE_IO:
            if info.dtype is not None:
                raise CorruptionError(f"item {req.storage_index.fqn!r}: a tensor item read as bytes")
            if info.transforms:
                data = self._untransform(info, req, raw, MAX_BYTES_ITEM)
            if not self.allow_pickle:
                data = restricted_bytes(req.storage_index.fqn, bytes(data))
            planner.load_bytes(req, io.BytesIO(bytes(data)))
            return
        if info.dtype is None or info.shape is None:
            raise CorruptionError(f"item {req.storage_index.fqn!r}: tensor without dtype/shape")
        dtype = dtype_from_name(info.dtype)
        n = 1
        for s in info.shape:
            n *= s
        if info.transforms:
            data = self._untransform(info, req, raw, n * dtype.itemsize)
        if n * dtype.itemsize != len(data):
            raise CorruptionError(f"item {req.storage_index.fqn!r}: {len(data)} bytes for shape {info.shape}")
        if n == 0:
            tensor = torch.empty(info.shape, dtype=dtype)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the tensor is only copied from
                tensor = torch.frombuffer(data, dtype=dtype).reshape(info.shape)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CorruptionError(f"item {req.storage_index.fqn!r}: size {tuple(tensor.size())}, "
                                  f"expected {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
