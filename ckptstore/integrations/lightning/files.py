"""The files of the Lightning plug-in: how a checkpoint dict is split into
store components and published, and the small pointer and detached files
Lightning sees at its paths (written atomically). Reading them back, as the
untrusted input they are, is :mod:`.lightning_trust`'s job."""

from __future__ import annotations

import os
import re
import struct
import threading
from base64 import b64encode
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from ... import RecordAuth
from ...errors import CommitConflictError, InvalidInputError
from ...options import AuthOptions, OpenOptions
from ...protocol import ComponentEntry, canonical_json
from ...protocol.auth import AuthPolicy, Keyring
from ...shims.lightning_private import PATH
from ...store import CheckpointStore, SaveRef
from ...torch.codec import (
    TypeRegistry,
    flatten,
    safetensors_stream,
    tree_from_json,
    tree_to_json,
)
from .paths import CheckpointDirs, is_remote, local_path, open_parent
from .paths import key as key_of

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


def encode_checkpoint(checkpoint: Mapping[str, Any], registry: TypeRegistry | None) -> dict[str, _Part]:
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
        parts[key] = _Part(fl.tree, tensors, comp, size)
    return parts


def _same_tensors(entry: ComponentEntry | None, p: _Part) -> bool:
    """Whether the part's tensors, as safetensors bytes, are exactly the published
    component ``entry`` (None: it had none), whatever layout the store gave it
    (whole, or pieces: ``ComponentEntry.matches``)."""
    if entry is None or not p.tensors:
        return entry is None and not p.tensors
    return entry.matches(safetensors_stream(p.tensors)[1])


def _canonical(x: Any) -> bytes:
    return tree_to_json(x)


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    _size, chunks = safetensors_stream(tensors)
    return b"".join(bytes(c) for c in chunks)


# ------------------------------------------------------------------ publishing


@dataclass
class Published:
    """A save of one step as published, for comparing later checkpoints of the same step with it."""

    ref: SaveRef
    trees: dict[str, bytes]  # key -> canonical JSON of its tree
    tensors: dict[str, ComponentEntry | None]  # key -> its tensor component's entry (None: no tensors)


def publish(store: CheckpointStore, step: int, parts: dict[str, _Part], path: str) -> Published:
    """Commit the checkpoint's parts as the save of ``step`` (or, if another
    writer of this attempt committed it first, read that one)."""
    doc = {
        "format": FORMAT,
        "keys": list(parts),
        "trees": {k: p.tree for k, p in parts.items()},
        "tensor_components": {k: p.component for k, p in parts.items() if p.component},
    }
    try:
        doc_bytes = tree_to_json(doc)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"checkpoint cannot be encoded as JSON: {exc}") from None
    comps = {p.component: p for p in parts.values() if p.component}
    metadata: dict[str, Any] = {"format": FORMAT, "first_path": os.path.basename(path)}
    if isinstance(parts.get("epoch"), _Part) and isinstance(parts["epoch"].tree, int):
        metadata["epoch"] = parts["epoch"].tree
    try:
        with store.save(step, metadata=metadata, expect=[DOC_COMPONENT, *comps]) as s:
            for name, p in sorted(comps.items()):
                _size, chunks = safetensors_stream(p.tensors)
                s.put(name, chunks)
            s.put(DOC_COMPONENT, doc_bytes)
        assert s.ref is not None
        entries = s.ref.components
        return Published(s.ref, {k: _canonical(p.tree) for k, p in parts.items()},
                         {k: entries[p.component] if p.component else None for k, p in parts.items()})
    except CommitConflictError:
        # another writer of this attempt (another plug-in instance) committed this step first
        assert store.attempt is not None
        return load_published(store, store.get_save(step, store.attempt.number))


def load_published(store: CheckpointStore, ref: SaveRef) -> Published:
    doc = tree_from_json(store.read(ref, DOC_COMPONENT))
    comps: dict[str, str] = doc["tensor_components"]
    return Published(
        ref,
        {k: _canonical(t) for k, t in doc["trees"].items()},
        {k: (ref.components[comps[k]] if k in comps else None) for k in doc["trees"]},
    )


def inline_state(pub: Published, parts: dict[str, _Part], step: int, max_inline_bytes: int) -> dict[str, Any]:
    """Keys whose content differs from the published save, to be carried in the pointer."""
    inline: dict[str, Any] = {}
    total = 0
    for key, p in parts.items():
        tree = _canonical(p.tree)
        if pub.trees.get(key) == tree and key in pub.tensors and _same_tensors(pub.tensors[key], p):
            continue  # identical: referenced from the save
        total += len(tree) + p.size
        if total > max_inline_bytes:
            raise InvalidInputError(
                f"step {step} was already saved in this attempt with different content under "
                f"{key!r} ({p.size} bytes of tensors); a store holds one save per step and attempt — "
                "save different weights at a different global_step"
            )
        inline[key] = {"tree": p.tree, "tensors": b64encode(tensor_bytes(p.tensors)).decode() if p.tensors else None}
    return inline


# ------------------------------------------------------------------ pointer files

#: the tag of a pointer is a record tag of kind "event" over this domain-separated digest, which no
#: record's body digest can equal (those hash canonical JSON, which starts with "{")
POINTER_TAG_DOMAIN = b"ckptstore/v1/lightning-pointer\x00"
POINTER_TAG_KIND = "event"
DETACHED_MAGIC = b"CKPTSTORE-LIGHTNING-DETACHED/2\n"
#: a path reserved by an asynchronous save still in flight (the same length as DETACHED_MAGIC)
PENDING_MAGIC = b"CKPTSTORE-LIGHTNING-PENDING/01\n"
#: the most bytes a reservation file has
MAX_PENDING_BYTES = 4096


def url_scheme(url: str) -> str:
    """``s3``, ``gs``, ... of a URL; ``file`` for a local path."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def filesystem(path: str, options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of a remote path (the plug-in's storage options apply to its own scheme)."""
    return get_filesystem(path, **dict(options or {}))


def write_atomic(path: PATH, data: bytes, options: Mapping[str, Any] | None = None,
                 dirs: CheckpointDirs | None = None) -> None:
    """Replace the file at ``path`` with ``data`` atomically (remote: one PUT;
    local: a temporary file created exclusively and no-follow in the same
    directory, fsynced, renamed over the name through the directory's
    descriptor, the directory fsynced). The directory is resolved as
    :func:`.paths.open_parent` does: below one of ``dirs`` no link is followed
    (a link there is an :class:`InvalidInputError`); a link at the name itself
    is replaced, never written through. On success the directory becomes one
    of ``dirs``."""
    p = os.fspath(path)
    if is_remote(p):
        fs = filesystem(p, options)
        with fs.open(p, "wb") as f:  # one PUT: atomic on object stores
            f.write(data)
    else:
        dfd, name, _root = open_parent(p, dirs, InvalidInputError, create=True)
        try:
            _replace_at(dfd, name, data, key_of(p))
        finally:
            os.close(dfd)
    if dirs is not None:
        dirs.note(p)


def check_writable(path: PATH, dirs: CheckpointDirs | None) -> None:
    """Refuse now (:class:`InvalidInputError`), before anything is committed, a local ``path``
    that :func:`write_atomic` would refuse for a link below one of ``dirs`` (its missing
    directories are made, as the write would make them)."""
    p = os.fspath(path)
    if not is_remote(p):
        os.close(open_parent(p, dirs, InvalidInputError, create=True)[0])


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _replace_at(dfd: int, name: str, data: bytes, where: str) -> None:
    tmp = f".ckptstore-pointer-{os.urandom(8).hex()}"
    fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except IsADirectoryError:
            raise InvalidInputError(
                f"{where}: a directory is where the checkpoint file belongs; remove it or save to another path"
            ) from None
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    os.fsync(dfd)


#: reservations made in this process whose saves are still running (path -> set when the save ends)
_IN_FLIGHT: dict[str, threading.Event] = {}
_IN_FLIGHT_LOCK = threading.Lock()
#: the longest a load waits for a save of this process that reserved its path
IN_FLIGHT_WAIT_SECONDS = 3600.0


def _flight_key(path: PATH) -> str:
    p = os.fspath(path)
    return p if is_remote(p) else os.path.abspath(local_path(p))


def mark_in_flight(path: PATH) -> None:
    """Note that a save of this process reserved ``path`` and is running."""
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.setdefault(_flight_key(path), threading.Event())


def mark_done(path: PATH) -> None:
    """The save that reserved ``path`` (if one did) has ended, committed or failed."""
    with _IN_FLIGHT_LOCK:
        event = _IN_FLIGHT.pop(_flight_key(path), None)
    if event is not None:
        event.set()


def wait_in_flight(path: PATH, timeout: float = IN_FLIGHT_WAIT_SECONDS) -> bool:
    """Wait for a save of this process that reserved ``path``; False if there is none (or it outlasts
    ``timeout``)."""
    with _IN_FLIGHT_LOCK:
        event = _IN_FLIGHT.get(_flight_key(path))
    return event is not None and event.wait(timeout)


def pending_bytes(url: str, run_id: str, step: int) -> bytes:
    """A reservation file: the magic line and which run's save of which step will replace it."""
    return PENDING_MAGIC + canonical_json({"store": url, "run_id": run_id, "step": step})


def reserve_path(path: PATH, data: bytes, options: Mapping[str, Any] | None = None,
                 dirs: CheckpointDirs | None = None) -> bool:
    """Create the file at ``path`` with ``data`` only if nothing is there (local: one exclusive,
    no-follow create relative to the directory's descriptor, resolved as :func:`write_atomic`
    resolves it, fsynced with its directory; remote: a PUT after an existence check, the
    plug-in being the job's one writer). True if this call created it."""
    p = os.fspath(path)
    if is_remote(p):
        fs = filesystem(p, options)
        if fs.exists(p):
            return False
        with fs.open(p, "wb") as f:
            f.write(data)
    else:
        dfd, name, _root = open_parent(p, dirs, InvalidInputError, create=True)
        try:
            try:
                fd = os.open(name, _CREATE, 0o644, dir_fd=dfd)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.fsync(dfd)
        finally:
            os.close(dfd)
    if dirs is not None:
        dirs.note(p)
    return True


def pointer_digest(doc: Mapping[str, Any]) -> str:
    """What a pointer's tag authenticates: every field but the tag, domain-separated."""
    body = {k: v for k, v in doc.items() if k != "auth"}
    return blake3.blake3(POINTER_TAG_DOMAIN + canonical_json(body)).hexdigest()


def make_pointer(
    ref: SaveRef, url: str, keys: list[str], inline: dict[str, Any], auth: RecordAuth | None = None
) -> bytes:
    doc: dict[str, Any] = {
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
    if auth is not None and auth.policy is not AuthPolicy.OFF and auth.keyring is not None:
        tag = auth.keyring.sign(POINTER_TAG_KIND, ref.run_id, pointer_digest(doc))
        if tag is not None:
            doc["auth"] = tag.to_json()
    return canonical_json(doc)  # compact: its size follows the inline bound (see pointer_cap)


# ------------------------------------------------------------------ detached hand-off files


def detached_bytes(doc_json: bytes, tensors: bytes, key: bytes) -> bytes:
    """A detached file: magic, a small header authenticated with ``key`` (the
    plug-in's per-instance secret, shared with its spawned workers), the JSON
    document and the safetensors bytes."""
    payload = doc_json + tensors
    head = {"format": DETACHED_FORMAT, "doc_size": len(doc_json), "size": len(payload),
            "blake3": blake3.blake3(payload).hexdigest()}
    head["tag"] = blake3.blake3(canonical_json(head), key=key).hexdigest()
    header = canonical_json(head)
    return DETACHED_MAGIC + struct.pack("<I", len(header)) + header + payload


# ------------------------------------------------------------------ removal


def write_pointer_for_latest(
    path: PATH, url: str, run_id: str, *, storage_options: Mapping[str, Any] | None = None,
    auth_policy: AuthPolicy | str = "off", keyring: Keyring | None = None,
) -> SaveRef | None:
    """Write a pointer at ``path`` to the run's newest complete Lightning save.

    For resuming when a process died between a commit and its pointer (or the
    pointer files were lost): ``trainer.fit(model, ckpt_path=path)``. Returns
    the save, or None (and writes nothing) when the run has no complete save.
    ``auth_policy``/``keyring``: as for :meth:`CheckpointStore.open` (with a
    key, the pointer is tagged).
    """
    store = CheckpointStore.open(url, run_id, mode="r", storage_options=storage_options,
                                 options=OpenOptions(auth=AuthOptions(auth_policy, keyring)))
    ref = store.latest_complete(deep=True)
    if ref is None:
        return None
    if ref.metadata.get("format") != FORMAT:
        raise InvalidInputError(f"save {ref.save_id} is not a Lightning save (format {ref.metadata.get('format')!r})")
    doc = tree_from_json(store.read(ref, DOC_COMPONENT))
    options = storage_options if url_scheme(os.fspath(path)) == url_scheme(url) else None  # the store's, for its scheme
    write_atomic(path, make_pointer(ref, store.backend.url, list(doc["keys"]), {}, store.auth), options)
    return ref


def map_tensors(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return {k: t.to(map_location) for k, t in tensors.items()}
    return tensors
