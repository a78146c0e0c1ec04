"""The files of the Lightning plug-in: how a checkpoint dict is split into
store components, and the small pointer files Lightning sees at its paths
(written atomically, parsed strictly)."""

from __future__ import annotations

import base64
import errno
import hmac
import os
import re
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

import blake3
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH

from ..authn import RecordAuth
from ..errors import (
    CorruptionError,
    InvalidInputError,
)
from ..protocol import canonical_json, decode_json
from ..protocol.auth import AuthPolicy, AuthTag, Keyring
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

#: what a pointer file may hold besides its inline state (the inline state is capped by ``max_inline_bytes``,
#: base64 makes it 4/3 as large)
POINTER_OVERHEAD_BYTES = 1 << 20
POINTER_FIELDS = frozenset(
    {"format", "store", "run_id", "step", "attempt", "save_id", "manifest_digest", "keys", "inline", "inline_digest"}
)
#: the tag of a pointer is a record tag of kind "event" over this domain-separated digest, which no
#: record's body digest can equal (those hash canonical JSON, which starts with "{")
POINTER_TAG_DOMAIN = b"ckptstore/v1/lightning-pointer\x00"
POINTER_TAG_KIND = "event"
DETACHED_MAGIC = b"CKPTSTORE-LIGHTNING-DETACHED/2\n"
MAX_DETACHED_HEADER = 4096
_DETACHED_FIELDS = frozenset({"format", "doc_size", "size", "blake3", "tag"})
_STEP_MAX = (1 << 63) - 1


class RemovalRefusedWarning(UserWarning):
    """``remove_checkpoint`` kept a file because it is not one this plug-in wrote (the message says why)."""


def pointer_cap(max_inline_bytes: int) -> int:
    """The most bytes a pointer file may have for a plug-in with this ``max_inline_bytes``."""
    return 2 * max_inline_bytes + POINTER_OVERHEAD_BYTES


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path.removeprefix("file://")


def url_scheme(url: str) -> str:
    """``s3``, ``gs``, ... of a URL; ``file`` for a local path."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def filesystem(path: str, options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of a remote path (the plug-in's storage options apply to its own scheme)."""
    return get_filesystem(path, **dict(options or {}))


def _write_atomic(path: _PATH, data: bytes, options: Mapping[str, Any] | None = None) -> None:
    p = os.fspath(path)
    if _is_remote(p):
        fs = filesystem(p, options)
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


_NOFOLLOW = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_fd(name: str, where: str, dir_fd: int | None = None) -> int:
    """A no-follow descriptor of the regular file ``name`` (FileNotFoundError when absent)."""
    try:
        fd = os.open(name, _NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint file not found: {where}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptionError(
                f"{where}: is a symbolic link; the plug-in never follows a link to a checkpoint file "
                "(put the file itself there)"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptionError(f"{where}: not a regular file")
    return fd


@contextmanager
def open_checked(path: _PATH, options: Mapping[str, Any] | None = None) -> Iterator[BinaryIO]:
    """The file at ``path`` for reading: local files opened without following a
    link and only if regular; remote ones through fsspec. A missing file is
    ``FileNotFoundError`` (what Lightning expects); a link or special file a
    :class:`CorruptionError`."""
    p = os.fspath(path)
    if _is_remote(p):
        fs = filesystem(p, options)
        try:
            f = fs.open(p, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"Checkpoint file not found: {p}") from None
        with f:
            yield f
        return
    with os.fdopen(_open_fd(_local(p), _local(p)), "rb") as lf:
        yield lf


def read_at_most(f: BinaryIO, limit: int, where: str, head: bytes = b"") -> bytes:
    """``head`` (what was read of ``f`` already) and the rest of ``f``, if that
    is at most ``limit`` bytes in all, else a :class:`CorruptionError`."""
    data = head + f.read(limit - len(head) + 1)
    if len(data) > limit:
        raise CorruptionError(f"{where}: more than the {limit} bytes allowed for a pointer file")
    return bytes(data)


def read_pointer(path: _PATH, *, max_bytes: int = pointer_cap(DEFAULT_MAX_INLINE_BYTES)) -> dict[str, Any]:
    """The pointer file at ``path``, checked for form (not yet against the store)."""
    where = os.fspath(path)
    with open_checked(path) as f:
        return parse_pointer(read_at_most(f, max_bytes, where), where, max_bytes)


def _pointer_type_error(doc: dict[str, Any]) -> str | None:
    for k in ("store", "run_id", "save_id", "manifest_digest", "inline_digest"):
        if not isinstance(doc[k], str):
            return k
    for k in ("step", "attempt"):
        v = doc[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _STEP_MAX:
            return k
    keys, inline = doc["keys"], doc["inline"]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        return "keys"
    if not isinstance(inline, dict):
        return "inline"
    for k, item in inline.items():
        if k not in keys or not isinstance(item, dict) or set(item) != {"tree", "tensors"}:
            return f"inline[{k[:64]!r}]"
        if item["tensors"] is not None and not isinstance(item["tensors"], str):
            return f"inline[{k[:64]!r}]"
    if "auth" in doc and AuthTag.parse(doc["auth"]) is None:
        return "auth"
    return None


def parse_pointer(raw: bytes, where: str, max_bytes: int) -> dict[str, Any]:
    """A pointer file's fields, parsed strictly (size cap, no duplicate keys, no
    unknown fields, every type checked, the inline digest matching); anything
    else is a :class:`CorruptionError` naming the file and the cause."""
    if not raw.lstrip()[:1] == b"{":
        raise CorruptionError(
            f"{where}: not a ckptstore pointer file (a torch.save checkpoint needs Lightning's default "
            "TorchCheckpointIO)"
        )
    doc = decode_json(raw, where=where, max_bytes=max_bytes)
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        raise CorruptionError(f"{where}: not a {POINTER_FORMAT} pointer file")
    missing = sorted(POINTER_FIELDS - set(doc))
    unknown = sorted(set(doc) - POINTER_FIELDS - {"auth"})
    if missing or unknown:
        raise CorruptionError(f"{where}: pointer file lacks fields {missing} / has unknown fields {unknown[:8]}")
    bad = _pointer_type_error(doc)
    if bad is not None:
        raise CorruptionError(f"{where}: pointer file mangles field {bad}")
    if blake3.blake3(_canonical(doc["inline"])).hexdigest() != doc["inline_digest"]:
        raise CorruptionError(f"{where}: the pointer's inline state does not match its digest")
    for k, item in doc["inline"].items():
        if item["tensors"] is not None:
            inline_tensor_bytes(item, f"{where}: inline tensors of {k[:64]!r}")
    return doc


def inline_tensor_bytes(item: Mapping[str, Any], where: str) -> bytes:
    """The safetensors bytes of one inline entry (strict base64)."""
    try:
        return base64.b64decode(item["tensors"], validate=True) if item["tensors"] else b""
    except ValueError:
        raise CorruptionError(f"{where}: not base64") from None


def pointer_digest(doc: Mapping[str, Any]) -> str:
    """What a pointer's tag authenticates: every field but the tag, domain-separated."""
    body = {k: v for k, v in doc.items() if k != "auth"}
    return blake3.blake3(POINTER_TAG_DOMAIN + canonical_json(body)).hexdigest()


def pointer_auth_problem(auth: RecordAuth, doc: Mapping[str, Any]) -> str | None:
    """None if the pointer is tagged with the run's key (or the policy is off), else why not."""
    if auth.policy is AuthPolicy.OFF:
        return None
    if auth.keyring is None:
        return "no key configured to check it"
    tag = AuthTag.parse(doc.get("auth"))
    return auth.keyring.check(POINTER_TAG_KIND, doc["run_id"], pointer_digest(doc), tag)


def _pointer(
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


def is_detached(head: bytes) -> bool:
    return head.startswith(DETACHED_MAGIC)


def detached_header(f: BinaryIO, where: str, key: bytes) -> dict[str, Any]:
    """The header of the detached file ``f`` (positioned at its start), checked
    against ``key`` before anything else is read."""
    start = f.read(len(DETACHED_MAGIC) + 4)
    if not is_detached(start) or len(start) != len(DETACHED_MAGIC) + 4:
        raise CorruptionError(f"{where}: not a detached file of this plug-in")
    (n,) = struct.unpack("<I", start[len(DETACHED_MAGIC):])
    if n > MAX_DETACHED_HEADER:
        raise CorruptionError(f"{where}: detached header of {n} bytes, more than the {MAX_DETACHED_HEADER} allowed")
    head = decode_json(f.read(n), where=where, max_bytes=MAX_DETACHED_HEADER, canonical=True)
    if not isinstance(head, dict) or set(head) != _DETACHED_FIELDS or not isinstance(head["tag"], str):
        raise CorruptionError(f"{where}: detached header has the wrong fields")
    body = {k: v for k, v in head.items() if k != "tag"}
    if not hmac.compare_digest(blake3.blake3(canonical_json(body), key=key).hexdigest(), head["tag"]):
        raise CorruptionError(
            f"{where}: a detached file not written by this plug-in (or its spawned workers); a detached file "
            "is a hand-off between the processes of one job, never a checkpoint to resume from"
        )
    return head


def read_detached(f: BinaryIO, where: str, key: bytes) -> tuple[bytes, bytes]:
    """(JSON document, safetensors bytes) of a detached file this plug-in wrote;
    reads no more than its authenticated size + 1."""
    head = detached_header(f, where, key)
    size, doc_size = head["size"], head["doc_size"]
    payload = f.read(size + 1)
    if len(payload) != size or blake3.blake3(payload).hexdigest() != head["blake3"]:
        raise CorruptionError(f"{where}: detached file is truncated or altered (its digest does not match)")
    return payload[:doc_size], payload[doc_size:]


# ------------------------------------------------------------------ removal


def remove_own_file(path: _PATH, mine: Callable[[BinaryIO, str], str | None],
                    options: Mapping[str, Any] | None = None) -> str | None:
    """Remove the file at ``path`` if ``mine(file, where)`` says this plug-in
    wrote it (returns None); else keep it and return why. A path with a ``..``
    component, a link or a special file is never removed; a missing file is
    nothing to do. Local files are judged and unlinked through one directory
    descriptor, and only if the name still names the file judged."""
    p = os.fspath(path)
    if ".." in re.split(r"[/\\]", p):
        return "its path contains '..'"
    if _is_remote(p):
        fs = filesystem(p, options)
        try:
            with fs.open(p, "rb") as f:
                why = mine(f, p)
        except FileNotFoundError:
            return None
        if why is None:
            fs.rm(p)
        return why
    lp = os.path.abspath(_local(p))
    d, name = os.path.split(lp)
    try:
        dfd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"its directory cannot be opened without following a link ({exc.strerror})"
    try:
        try:
            fd = _open_fd(name, lp, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except CorruptionError as exc:
            return str(exc).removeprefix(f"{lp}: ")
        judged = os.fstat(fd)
        with os.fdopen(fd, "rb") as f:
            why = mine(f, lp)
        if why is not None:
            return why
        now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (judged.st_dev, judged.st_ino):
            return "it was replaced while being checked"
        os.unlink(name, dir_fd=dfd)
        return None
    finally:
        os.close(dfd)


def write_pointer_for_latest(
    path: _PATH, url: str, run_id: str, *, storage_options: Mapping[str, Any] | None = None,
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
                                 auth_policy=auth_policy, keyring=keyring)
    ref = store.latest_complete(deep=True)
    if ref is None:
        return None
    if ref.metadata.get("format") != FORMAT:
        raise InvalidInputError(f"save {ref.save_id} is not a Lightning save (format {ref.metadata.get('format')!r})")
    doc = tree_from_json(store.read(ref, DOC_COMPONENT))
    _write_atomic(path, _pointer(ref, store.backend.url, list(doc["keys"]), {}, store.auth), storage_options)
    return ref


def _map(tensors: dict[str, torch.Tensor], map_location: Any) -> dict[str, torch.Tensor]:
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        return {k: t.to(map_location) for k, t in tensors.items()}
    return tensors
