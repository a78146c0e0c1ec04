"""JSON (never pickle) encoding of ``torch.distributed.checkpoint`` Metadata.

DCP's own FileSystemWriter pickles its ``Metadata`` object into ``.metadata``;
reading such a file runs arbitrary code. Here the metadata is a canonical JSON
document with an explicit schema; decoding builds the dataclasses field by
field and accepts only known dtypes, layouts and plain JSON values.
Stored metadata is input: :func:`decode_metadata` uses the strict bounded
decoder of :mod:`ckptstore.protocol.canonical` and checks every field (exact
key sets, extents, chunks that tile each tensor exactly, one matching item per
chunk); any failure is a :class:`~ckptstore.CorruptionError` naming the field.

Schema (``"format": "ckptstore.dcp/1"``)::

    {"format": ..., "version": DCP version string or null,
     "state_dict_metadata": {fqn: {"type": "tensor", "dtype": "float32", "layout": "strided",
                                    "requires_grad": false, "size": [...],
                                    "chunks": [{"offsets": [...], "sizes": [...]}, ...]}
                             | {"type": "bytes"}},
     "planner_data": <JSON value; tuples tagged {"__tuple__": [...]}>,
     "storage_meta": {"checkpoint_id": str|null, "save_id": str|null, "modules": [...]} | null,
     "items": [ItemInfo.to_json(), ...]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import CorruptionError, InvalidInputError
from ...protocol.canonical import canonical_json, decode_json

FORMAT = "ckptstore.dcp/1"


@dataclass(frozen=True)
class ItemInfo:
    """Where one DCP item's bytes are, and their digest.

    ``offset``/``length`` address the stored bytes (after any stream
    transform) inside ``component``; ``blake3`` is their digest, checked by the
    reader on every range it reads. ``dtype``/``shape`` describe a tensor
    chunk stored as raw little-endian bytes (None for a BYTE_IO item)."""

    component: str
    offset: int
    length: int
    blake3: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    transforms: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "component": self.component, "offset": self.offset, "length": self.length, "blake3": self.blake3,
            "dtype": self.dtype, "shape": list(self.shape) if self.shape is not None else None,
            "transforms": list(self.transforms),
        }


@dataclass
class StorageData:
    """``Metadata.storage_data`` of a save read from the store: the items and
    the save they belong to (so every rank reads the same save)."""

    items: dict[MetadataIndex, ItemInfo]
    ref: dict[str, Any]


_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_LAYOUTS: dict[str, torch.layout] = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        raise CorruptionError(f"DCP metadata names an unknown dtype {name!r}")
    return dt


def _plain(x: Any, where: str) -> Any:
    """A JSON-able copy of ``x``; tuples are tagged so they come back as tuples."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple):
        return {"__tuple__": [_plain(v, where) for v in x]}
    if isinstance(x, list):
        return [_plain(v, where) for v in x]
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise InvalidInputError(f"{where}: only string keys can be stored as JSON")
        return {k: _plain(v, where) for k, v in x.items()}
    raise InvalidInputError(f"{where}: {type(x).__name__} cannot be stored as JSON (ckptstore never pickles)")


def _index_json(idx: MetadataIndex) -> dict[str, Any]:
    return {"fqn": idx.fqn, "offset": list(idx.offset) if idx.offset is not None else None, "index": idx.index}


def encode_metadata(md: Metadata, items: dict[MetadataIndex, ItemInfo]) -> bytes:
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            sdm[fqn] = {
                "type": "tensor", "dtype": dtype_name(m.properties.dtype),
                "layout": str(m.properties.layout).removeprefix("torch."),
                "requires_grad": bool(m.properties.requires_grad), "size": list(m.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks],
            }
        elif isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise InvalidInputError(f"DCP metadata for {fqn!r} has an unknown type {type(m).__name__}")
    sm = md.storage_meta
    doc = {
        "format": FORMAT,
        "version": md.version,
        "state_dict_metadata": sdm,
        "planner_data": _plain(md.planner_data, "DCP planner_data"),
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id, "modules": list(sm.modules),
        },
        "items": [{"index": _index_json(i), **info.to_json()} for i, info in items.items()],
    }
    try:
        return canonical_json(doc)
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"DCP metadata cannot be stored as JSON: {exc}") from None


#: the largest metadata document read (a million items of a few hundred bytes)
MAX_METADATA_BYTES = 1 << 30
#: the most cells the chunk-tiling check may lay out for one tensor (bytes of scratch memory)
MAX_TILING_CELLS = 1 << 24
#: a dimension, an offset or a length: the range a stored integer may take
MAX_EXTENT = 1 << 53

_DOC_KEYS = {"format", "version", "state_dict_metadata", "planner_data", "storage_meta", "items"}
_TENSOR_KEYS = {"type", "dtype", "layout", "requires_grad", "size", "chunks"}
_ITEM_KEYS = {"index", "component", "offset", "length", "blake3", "dtype", "shape", "transforms"}
_HEX = frozenset("0123456789abcdef")


class _Bad(Exception):
    """A field that fails its check: (path, what is wrong)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")


def _obj(x: Any, path: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise _Bad(path, f"expected an object, found {type(x).__name__}")
    if set(x) != keys:
        missing, extra = sorted(keys - set(x)), sorted(set(x) - keys)
        raise _Bad(path, f"fields {'missing ' + str(missing) if missing else ''}"
                         f"{' ' if missing and extra else ''}{'unknown ' + str(extra)[:200] if extra else ''}")
    return x


def _nat(x: Any, path: str) -> int:
    if type(x) is not int or not 0 <= x < MAX_EXTENT:
        raise _Bad(path, f"expected an integer in [0, 2**53), found {str(x)[:40]}")
    return x


def _nats(x: Any, path: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(x, list):
        raise _Bad(path, f"expected a list of integers, found {type(x).__name__}")
    if n is not None and len(x) != n:
        raise _Bad(path, f"{len(x)} entries for a tensor of {n} dimensions")
    return tuple(_nat(v, f"{path}[{i}]") for i, v in enumerate(x))


def _str(x: Any, path: str, *, nullable: bool = False) -> Any:
    if x is None and nullable:
        return None
    if not isinstance(x, str):
        raise _Bad(path, f"expected a string, found {type(x).__name__}")
    return x


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_tiling(fqn: str, size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """The chunks cover the tensor exactly: each inside it, none overlapping
    another, no element left uncovered (a gap would leave part of the tensor
    silently unloaded)."""
    path = f"state_dict_metadata[{fqn!r}].chunks"
    for i, (off, sz) in enumerate(chunks):
        for d, (o, n, full) in enumerate(zip(off, sz, size, strict=True)):
            if o + n > full:
                raise _Bad(f"{path}[{i}]", f"spans [{o}, {o + n}) of dimension {d}, which has {full}")
    if _numel(size) == 0:
        return
    live = [(off, sz) for off, sz in chunks if _numel(sz) > 0]
    if sum(_numel(sz) for _, sz in live) != _numel(size):
        raise _Bad(path, f"cover {sum(_numel(sz) for _, sz in live)} of the tensor's {_numel(size)} elements "
                         "(a gap or an overlap)")
    if len(live) == 1:
        return  # one chunk inside the tensor with all its elements: the whole tensor
    # the chunks' boundaries cut the tensor into cells; every cell covered exactly once
    cuts: list[list[int]] = []
    for d, full in enumerate(size):
        points = {0, full}
        for off, sz in live:
            points.update((off[d], off[d] + sz[d]))
        cuts.append(sorted(points))
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    if cells > MAX_TILING_CELLS:
        raise _Bad(path, f"{len(live)} chunks cut the tensor into {cells} cells, more than the "
                         f"{MAX_TILING_CELLS} this reader checks")
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    covered = np.zeros([len(c) - 1 for c in cuts], dtype=np.bool_)
    for i, (off, sz) in enumerate(live):
        where = tuple(slice(index[d][o], index[d][o + n]) for d, (o, n) in enumerate(zip(off, sz, strict=True)))
        if covered[where].any():
            raise _Bad(f"{path}[{i}]", "overlaps another chunk")
        covered[where] = True
    if not covered.all():
        raise _Bad(path, "leave part of the tensor uncovered")


def _tensor_md(fqn: str, m: Any) -> TensorStorageMetadata:
    path = f"state_dict_metadata[{fqn!r}]"
    m = _obj(m, path, _TENSOR_KEYS)
    if not isinstance(m["dtype"], str) or m["dtype"] not in _DTYPES:
        raise _Bad(f"{path}.dtype", f"unknown dtype {str(m['dtype'])[:40]!r}")
    layout = _LAYOUTS.get(m["layout"]) if isinstance(m["layout"], str) else None
    if layout is None:
        raise _Bad(f"{path}.layout", f"unknown layout {str(m['layout'])[:40]!r}")
    if type(m["requires_grad"]) is not bool:
        raise _Bad(f"{path}.requires_grad", "expected true or false")
    size = _nats(m["size"], f"{path}.size")
    if _numel(size) * _DTYPES[m["dtype"]].itemsize >= 1 << 63:
        raise _Bad(f"{path}.size", f"{list(size)} is larger than any tensor")
    if not isinstance(m["chunks"], list) or not m["chunks"]:
        raise _Bad(f"{path}.chunks", "expected a non-empty list")
    chunks = []
    for i, c in enumerate(m["chunks"]):
        c = _obj(c, f"{path}.chunks[{i}]", {"offsets", "sizes"})
        chunks.append((_nats(c["offsets"], f"{path}.chunks[{i}].offsets", len(size)),
                       _nats(c["sizes"], f"{path}.chunks[{i}].sizes", len(size))))
    check_tiling(fqn, size, chunks)
    props = TensorProperties(dtype=_DTYPES[m["dtype"]], layout=layout, requires_grad=m["requires_grad"])
    return TensorStorageMetadata(
        properties=props, size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z in chunks],
    )


def _plain_value(x: Any, path: str) -> Any:
    """planner_data back from JSON: tuples come back from their tags (depth is bounded by the decoder)."""
    if isinstance(x, list):
        return [_plain_value(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        if "__tuple__" in x:
            if set(x) != {"__tuple__"} or not isinstance(x["__tuple__"], list):
                raise _Bad(path, "a tuple tag must be {\"__tuple__\": [...]} alone")
            return tuple(_plain_value(v, f"{path}[{i}]") for i, v in enumerate(x["__tuple__"]))
        return {k: _plain_value(v, f"{path}[{k!r}]") for k, v in x.items()}
    return x


def _item(i: int, d: Any) -> tuple[MetadataIndex, ItemInfo]:
    path = f"items[{i}]"
    d = _obj(d, path, _ITEM_KEYS)
    idx = _obj(d["index"], f"{path}.index", {"fqn", "offset", "index"})
    fqn = _str(idx["fqn"], f"{path}.index.fqn")
    offset = None if idx["offset"] is None else list(_nats(idx["offset"], f"{path}.index.offset"))
    if idx["index"] is not None:
        _nat(idx["index"], f"{path}.index.index")
    component = _str(d["component"], f"{path}.component")
    if not component:
        raise _Bad(f"{path}.component", "empty")
    blake = _str(d["blake3"], f"{path}.blake3")
    if len(blake) != 64 or not set(blake) <= _HEX:
        raise _Bad(f"{path}.blake3", "expected 64 lowercase hex digits")
    dtype = _str(d["dtype"], f"{path}.dtype", nullable=True)
    if dtype is not None and dtype not in _DTYPES:
        raise _Bad(f"{path}.dtype", f"unknown dtype {dtype[:40]!r}")
    shape = None if d["shape"] is None else _nats(d["shape"], f"{path}.shape")
    if (dtype is None) != (shape is None):
        raise _Bad(path, "a tensor item needs both dtype and shape, a bytes item neither")
    if not isinstance(d["transforms"], list):
        raise _Bad(f"{path}.transforms", "expected a list of descriptors")
    transforms = tuple(_str(t, f"{path}.transforms[{j}]") for j, t in enumerate(d["transforms"]))
    for j, t in enumerate(transforms):
        name, sep, version = t.partition("/")
        if not name or not sep or not version:
            raise _Bad(f"{path}.transforms[{j}]", f"{t[:60]!r} is not a NAME/VERSION descriptor")
    info = ItemInfo(component, _nat(d["offset"], f"{path}.offset"), _nat(d["length"], f"{path}.length"), blake,
                    dtype, shape, transforms)
    if dtype is not None and shape is not None and not transforms:
        want = _numel(shape) * _DTYPES[dtype].itemsize
        if info.length != want:
            raise _Bad(f"{path}.length", f"{info.length} bytes for a {dtype} tensor of shape {list(shape)} ({want})")
    return MetadataIndex(fqn, offset, idx["index"]), info


def _check_items(sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata],
                 items: dict[MetadataIndex, ItemInfo]) -> None:
    """Every chunk of every tensor, and every bytes entry, has exactly one
    stored item that matches it; no item belongs to nothing."""
    want: dict[MetadataIndex, TensorStorageMetadata | BytesStorageMetadata | ChunkStorageMetadata] = {}
    for fqn, m in sdm.items():
        if isinstance(m, BytesStorageMetadata):
            want[MetadataIndex(fqn)] = m
        else:
            for c in m.chunks:
                want[MetadataIndex(fqn, c.offsets)] = c
    for idx, info in items.items():
        target = want.get(idx)
        where = f"items[{idx.fqn!r}, offset {list(idx.offset) if idx.offset is not None else None}]"
        if target is None:
            raise _Bad(where, "belongs to no tensor chunk or bytes entry of state_dict_metadata")
        if isinstance(target, BytesStorageMetadata):
            if info.dtype is not None:
                raise _Bad(where, "a tensor item for a bytes entry")
            continue
        m = sdm[idx.fqn]
        assert isinstance(m, TensorStorageMetadata) and isinstance(target, ChunkStorageMetadata)
        if info.dtype is None or info.shape is None:
            raise _Bad(where, "a bytes item for a tensor chunk")
        if _DTYPES[info.dtype] != m.properties.dtype or tuple(info.shape) != tuple(target.sizes):
            raise _Bad(where, f"holds a {info.dtype} {list(info.shape)}, the chunk is "
                              f"{dtype_name(m.properties.dtype)} {list(target.sizes)}")
    missing = [i for i in want if i not in items]
    if missing:
        i = missing[0]
        raise _Bad(f"state_dict_metadata[{i.fqn!r}]",
                   f"{len(missing)} chunk(s) have no stored item (first at offset "
                   f"{list(i.offset) if i.offset is not None else None}): they would be left unloaded")


def decode_metadata(data: bytes, where: str) -> tuple[Metadata, dict[MetadataIndex, ItemInfo]]:
    """Decode a stored metadata document strictly (canonical JSON decoder:
    bounded size, depth and integers, no duplicate keys), checking every
    field: exact key sets, known dtypes and layouts, non-negative extents,
    chunks that tile each tensor exactly, one matching item per chunk, item
    lengths that match their shapes. Any failure is a :class:`CorruptionError`
    naming the field."""
    doc = decode_json(data, where=f"{where}: DCP metadata", max_bytes=MAX_METADATA_BYTES)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"{where}: not a {FORMAT} document")
    try:
        doc = _obj(doc, "(top)", _DOC_KEYS)
        _str(doc["version"], "version", nullable=True)
        raw_sdm = doc["state_dict_metadata"]
        if not isinstance(raw_sdm, dict):
            raise _Bad("state_dict_metadata", "expected an object")
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, m in raw_sdm.items():
            if isinstance(m, dict) and m.get("type") == "bytes":
                _obj(m, f"state_dict_metadata[{fqn!r}]", {"type"})
                sdm[fqn] = BytesStorageMetadata()
            elif isinstance(m, dict) and m.get("type") == "tensor":
                sdm[fqn] = _tensor_md(fqn, m)
            else:
                found = m.get("type") if isinstance(m, dict) else m
                raise _Bad(f"state_dict_metadata[{fqn!r}].type", f"unknown item type {str(found)[:40]!r}")
        sm = doc["storage_meta"]
        storage_meta = None
        if sm is not None:
            sm = _obj(sm, "storage_meta", {"checkpoint_id", "save_id", "modules"})
            if not isinstance(sm["modules"], list):
                raise _Bad("storage_meta.modules", "expected a list of strings")
            storage_meta = StorageMeta(
                checkpoint_id=_str(sm["checkpoint_id"], "storage_meta.checkpoint_id", nullable=True),
                save_id=_str(sm["save_id"], "storage_meta.save_id", nullable=True),
                modules=[_str(x, f"storage_meta.modules[{i}]") for i, x in enumerate(sm["modules"])],
            )
        if not isinstance(doc["items"], list):
            raise _Bad("items", "expected a list")
        items: dict[MetadataIndex, ItemInfo] = {}
        for i, d in enumerate(doc["items"]):
            idx, info = _item(i, d)
            if idx in items:
                raise _Bad(f"items[{i}]", f"a second item for {idx.fqn!r} at the same offset")
            items[idx] = info
        _check_items(sdm, items)
        md = Metadata(state_dict_metadata=sdm, planner_data=_plain_value(doc["planner_data"], "planner_data"),
                      storage_meta=storage_meta, version=doc["version"])
    except _Bad as exc:
        raise CorruptionError(f"{where}: DCP metadata field {exc}") from None
    return md, items
