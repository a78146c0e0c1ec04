"""JSON (never pickle) encoding of ``torch.distributed.checkpoint`` Metadata.

DCP's own FileSystemWriter pickles its ``Metadata`` object into ``.metadata``;
reading such a file runs arbitrary code. Here the metadata is a canonical JSON
document with an explicit schema; decoding builds the dataclasses field by
field and accepts only known dtypes, layouts and plain JSON values.

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

import json
from dataclasses import dataclass
from typing import Any

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

from ..errors import CorruptionError, InvalidInputError

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

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ItemInfo:
        shape = d.get("shape")
        if d.get("dtype") is not None:
            dtype_from_name(str(d["dtype"]))  # refuse an unknown dtype when decoding, not later
        return cls(
            str(d["component"]), _int(d["offset"]), _int(d["length"]), str(d["blake3"]),
            None if d.get("dtype") is None else str(d["dtype"]),
            None if shape is None else tuple(_int(x) for x in shape),
            tuple(str(t) for t in d.get("transforms") or ()),
        )


@dataclass
class StorageData:
    """``Metadata.storage_data`` of a save read from the store: the items and
    the save they belong to (so every rank reads the same save)."""

    items: dict[MetadataIndex, ItemInfo]
    ref: dict[str, Any]


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise CorruptionError(f"DCP metadata: expected an integer, found {x!r}")
    return x


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


def _unplain(x: Any) -> Any:
    if isinstance(x, list):
        return [_unplain(v) for v in x]
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_unplain(v) for v in x["__tuple__"])
        return {k: _unplain(v) for k, v in x.items()}
    return x


def _index_json(idx: MetadataIndex) -> dict[str, Any]:
    return {"fqn": idx.fqn, "offset": list(idx.offset) if idx.offset is not None else None, "index": idx.index}


def _index_from(d: dict[str, Any]) -> MetadataIndex:
    off = d.get("offset")
    return MetadataIndex(str(d["fqn"]), None if off is None else [_int(x) for x in off], d.get("index"))


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
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_metadata(data: bytes, where: str) -> tuple[Metadata, dict[MetadataIndex, ItemInfo]]:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptionError(f"{where}: DCP metadata is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptionError(f"{where}: not a {FORMAT} document")
    try:
        sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, m in dict(doc["state_dict_metadata"]).items():
            if m["type"] == "bytes":
                sdm[str(fqn)] = BytesStorageMetadata()
                continue
            if m["type"] != "tensor":
                raise CorruptionError(f"{where}: unknown item type {m['type']!r}")
            layout = _LAYOUTS.get(str(m.get("layout", "strided")))
            if layout is None:
                raise CorruptionError(f"{where}: unknown layout {m.get('layout')!r}")
            props = TensorProperties(dtype=dtype_from_name(str(m["dtype"])), layout=layout,
                                     requires_grad=bool(m.get("requires_grad", False)))
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size([_int(x) for x in c["offsets"]]),
                                     sizes=torch.Size([_int(x) for x in c["sizes"]]))
                for c in m["chunks"]
            ]
            sdm[str(fqn)] = TensorStorageMetadata(properties=props, size=torch.Size([_int(x) for x in m["size"]]),
                                                  chunks=chunks)
        sm = doc.get("storage_meta")
        storage_meta = None if sm is None else StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"),
            modules=[str(x) for x in sm.get("modules", [])],
        )
        items = {_index_from(d["index"]): ItemInfo.from_json(d) for d in doc["items"]}
        md = Metadata(state_dict_metadata=sdm, planner_data=_unplain(doc.get("planner_data")),
                      storage_meta=storage_meta, version=doc.get("version"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptionError(f"{where}: DCP metadata has a missing or malformed field ({exc})") from None
    return md, items
