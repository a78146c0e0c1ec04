"""The files of the Lightning plug-in: how a checkpoint dict is split into
store components, and the small pointer files Lightning sees at its paths
(written atomically, parsed strictly)."""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from ..errors import (
    CorruptionError,
    InvalidInputError,
)
from ..store import CheckpointStore, SaveRef
from ..torch.codec import (
    TypeRegistry,
    flatten,
    safetensors_stream,
    tree_from_json,
    tree_to_json,
)

FORMAT = "ckptstore.lightning/1"
POINTER_FORMAT = "ckptstore.lightning-pointer/1"
#: a dict without ``global_step`` (Lightning's spawn launcher hands the weights to the main process this
#: way) is not a training checkpoint: it is written at the path as one self-describing safetensors file
DETACHED_FORMAT = "ckptstore.lightning-detached/1"
DOC_COMPONENT = "checkpoint.json"
DEFAULT_MAX_INLINE_BYTES = 4 << 20



# ------------------------------------------------------------------ encoding


@dataclass
class _Part:
    """One top-level key of a checkpoint dict, flattened."""

    tree: Any
    tensors: dict[str, torch.Tensor]
    component: str | None
    digest: str | None  # BLAKE3 of the safetensors bytes of ``tensors`` (None: no tensors)
    size: int


def _component_name(key: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", key).lstrip(".-") or "_"
    if safe != key or len(safe) > 200:
        safe = f"{safe[:200]}-{blake3.blake3(key.encode()).hexdigest()[:12]}"
    return f"tensors/{safe}.safetensors"


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t


def _encode(checkpoint: Mapping[str, Any], registry: TypeRegistry | None) -> dict[str, _Part]:
    if not isinstance(checkpoint, Mapping):
        raise InvalidInputError(f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}")
    parts: dict[str, _Part] = {}
    for key, value in checkpoint.items():
        if not isinstance(key, str):
            raise InvalidInputError(f"checkpoint key {key!r} must be a string")
        try:
            fl = flatten(value, registry=registry)
        except InvalidInputError as exc:
            msg = str(exc)
            if msg.startswith("state"):
                msg = f"checkpoint[{key!r}]" + msg[len("state"):]
            raise InvalidInputError(msg) from None
        tensors = {k: _cpu(t) for k, t in fl.tensors.items()}
        comp = None
        size = 0
        if tensors:
            comp = _component_name(key)
            size, _chunks = safetensors_stream(tensors)
        parts[key] = _Part(fl.tree, tensors, comp, None, size)
    return parts


def _digest(p: _Part) -> str | None:
    """BLAKE3 of the part's safetensors bytes (what the store would record), computed once."""
    if p.digest is None and p.tensors:
        h = blake3.blake3()
        for c in safetensors_stream(p.tensors)[1]:
            h.update(c)
        p.digest = h.hexdigest()
    return p.digest


def _canonical(x: Any) -> bytes:
    return tree_to_json(x)


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    _size, chunks = safetensors_stream(tensors)
    return b"".join(bytes(c) for c in chunks)


# ------------------------------------------------------------------ pointer files


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path.removeprefix("file://")


def _write_atomic(path: _PATH, data: bytes) -> None:
    p = os.fspath(path)
    if _is_remote(p):
        fs = get_filesystem(p)
        with fs.open(p, "wb") as f:  # one PUT: atomic on object stores
            f.write(data)
        return
    p = _local(p)
    d = os.path.dirname(os.path.abspath(p))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckptstore-pointer-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _read_file(path: _PATH) -> bytes:
    p = os.fspath(path)
    if _is_remote(p):
        fs = get_filesystem(p)
        if not fs.exists(p):
            raise FileNotFoundError(f"Checkpoint file not found: {p}")
        with fs.open(p, "rb") as f:
            data: bytes = f.read()
            return data
    p = _local(p)
    if not os.path.exists(p):
        raise FileNotFoundError(f"Checkpoint file not found: {p}")
    with open(p, "rb") as f:
        return f.read()


def read_pointer(path: _PATH) -> dict[str, Any]:
    """The pointer file at ``path``, checked for form (not yet against the store)."""
    return _parse_pointer(_read_file(path), path)


def _detached_meta(raw: bytes) -> dict[str, Any]:
    """The safetensors ``__metadata__`` of ``raw`` ({} when it is not a safetensors file)."""
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        if n > len(raw) - 8:
            return {}
        meta = json.loads(raw[8 : 8 + n].decode()).get("__metadata__")
    except (struct.error, UnicodeDecodeError, ValueError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _parse_pointer(raw: bytes, path: _PATH) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise CorruptionError(
            f"{os.fspath(path)}: not a ckptstore pointer file (not JSON; a torch.save checkpoint needs "
            "Lightning's default TorchCheckpointIO)"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        raise CorruptionError(f"{os.fspath(path)}: not a {POINTER_FORMAT} pointer file")
    try:
        for k in ("store", "run_id", "save_id", "manifest_digest"):
            if not isinstance(doc[k], str):
                raise TypeError(k)
        for k in ("step", "attempt"):
            if not isinstance(doc[k], int):
                raise TypeError(k)
        if not isinstance(doc["keys"], list) or not isinstance(doc["inline"], dict):
            raise TypeError("keys/inline")
    except (KeyError, TypeError) as exc:
        raise CorruptionError(f"{os.fspath(path)}: pointer file lacks or mangles field {exc}") from None
    if blake3.blake3(_canonical(doc["inline"])).hexdigest() != doc.get("inline_digest"):
        raise CorruptionError(f"{os.fspath(path)}: the pointer's inline state does not match its digest")
    return doc


def _pointer(ref: SaveRef, url: str, keys: list[str], inline: dict[str, Any]) -> bytes:
    doc = {
        "format": POINTER_FORMAT,
        "store": url,
        "run_id": ref.run_id,
        "step": ref.step,
        "attempt": ref.attempt,
        "save_id": ref.save_id,
        "manifest_digest": ref.manifest_digest,
        "keys": keys,
        "inline": inline,
        "inline_digest": blake3.blake3(_canonical(inline)).hexdigest(),
    }
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def write_pointer_for_latest(
    path: _PATH, url: str, run_id: str, *, storage_options: Mapping[str, Any] | None = None
) -> SaveRef | None:
    """Write a pointer at ``path`` to the run's newest complete Lightning save.

    For resuming when a process died between a commit and its pointer (or the
    pointer files were lost): ``trainer.fit(model, ckpt_path=path)``. Returns
    the save, or None (and writes nothing) when the run has no complete save.
    """
    store = CheckpointStore.open(url, run_id, mode="r", storage_options=storage_options)
    ref = store.latest_complete(deep=True)
    if ref is None:
        return None
    if ref.metadata.get("format") != FORMAT:
        raise InvalidInputError(f"save {ref.save_id} is not a Lightning save (format {ref.metadata.get('format')!r})")
    doc = tree_from_json(store.read(ref, DOC_COMPONENT))
    _write_atomic(path, _pointer(ref, store.backend.url, list(doc["keys"]), {}))
    return ref


def _map(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return {k: t.to(map_location) for k, t in tensors.items()}
    return tensors
