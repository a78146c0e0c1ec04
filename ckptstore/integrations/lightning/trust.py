"""What the Lightning plug-in reads back is input (``protocol_spec/THREATS.md``
§4.5): pointer and detached files are opened without following a link, read
within a size cap and parsed strictly; a pointer's commit and inline state are
checked against the auth policy; a file is removed only after it is proven to
be one the plug-in wrote."""

from __future__ import annotations

import base64
import errno
import hmac
import os
import stat
import struct
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, BinaryIO

import blake3

from ... import RecordAuth, UnauthenticatedWarning
from ...errors import CorruptionError, NotFoundError
from ...protocol import canonical_json, decode_json
from ...protocol.auth import AuthPolicy, AuthTag
from ...protocol.selection import SkipReason
from ...shims.lightning_private import PATH
from ...store import CheckpointStore, SaveRef
from ...torch.codec import TypeRegistry, load_safetensors, tree_from_json, unflatten
from .files import (
    DEFAULT_MAX_INLINE_BYTES,
    DETACHED_MAGIC,
    MAX_PENDING_BYTES,
    PENDING_MAGIC,
    POINTER_FORMAT,
    POINTER_TAG_KIND,
    filesystem,
    map_tensors,
    pointer_digest,
)
from .paths import CheckpointDirs, has_dotdot, is_remote, key, open_parent

#: what a pointer file may hold besides its inline state (the inline state is capped by ``max_inline_bytes``,
#: base64 makes it 4/3 as large)
POINTER_OVERHEAD_BYTES = 1 << 20


POINTER_FIELDS = frozenset(
    {"format", "store", "run_id", "step", "attempt", "save_id", "manifest_digest", "keys", "inline", "inline_digest"}
)


MAX_DETACHED_HEADER = 4096


_DETACHED_FIELDS = frozenset({"format", "doc_size", "size", "blake3", "tag"})


_STEP_MAX = (1 << 63) - 1


class RemovalRefusedWarning(UserWarning):
    """``remove_checkpoint`` kept a file because it is not one this plug-in wrote (the message says why)."""


def pointer_cap(max_inline_bytes: int) -> int:
    """The most bytes a pointer file may have for a plug-in with this ``max_inline_bytes``."""
    return 2 * max_inline_bytes + POINTER_OVERHEAD_BYTES


_NOFOLLOW = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def sibling_target(name: str, dir_fd: int | None = None) -> str | None:
    """The target of the symbolic link ``name`` if it is a *sibling link* (a
    bare file name in the link's own directory, as Lightning's
    ``save_last="link"`` makes: ``last.ckpt -> epoch=3-step=12.ckpt``), else
    None (not a link, or a link with a ``/``, ``.`` or ``..`` in its target)."""
    try:
        target = os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return None
    if not target or target in (".", "..") or "/" in target or (os.sep != "/" and os.sep in target):
        return None
    return target


def _open_fd(name: str, where: str, dir_fd: int | None = None, *, hop: bool = False) -> int:
    """A no-follow descriptor of the regular file ``name`` (FileNotFoundError
    when absent). With ``hop``, a sibling link (:func:`sibling_target`) is
    followed one step, to a regular file opened no-follow in the same
    directory; any other link is refused."""
    try:
        fd = os.open(name, _NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint file not found: {where}") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        target = sibling_target(name, dir_fd) if hop else None
        if target is None:
            raise CorruptionError(
                f"{where}: is a symbolic link; the plug-in never follows a link to a checkpoint file "
                "(put the file itself there; only a link to a file in the same directory, as "
                "ModelCheckpoint(save_last='link') makes, is read)"
            ) from None
        sibling = target if dir_fd is not None else os.path.join(os.path.dirname(name), target)
        return _open_fd(sibling, f"{where} -> {target}", dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptionError(f"{where}: not a regular file")
    return fd


@contextmanager
def open_checked(path: PATH, options: Mapping[str, Any] | None = None,
                 dirs: CheckpointDirs | None = None) -> Iterator[BinaryIO]:
    """The file at ``path`` for reading: local files opened without following a
    link and only if regular, their directory resolved as
    :func:`.paths.open_parent` does (below one of ``dirs``, no link anywhere in
    the path); remote ones through fsspec. A missing file is
    ``FileNotFoundError`` (what Lightning expects); a link or special file a
    :class:`CorruptionError`."""
    p = os.fspath(path)
    if is_remote(p):
        fs = filesystem(p, options)
        try:
            f = fs.open(p, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"Checkpoint file not found: {p}") from None
        with f:
            yield f
        return
    lp = key(p)
    try:
        dfd, name, _root = open_parent(p, dirs, CorruptionError)
    except FileNotFoundError:
        raise FileNotFoundError(f"Checkpoint file not found: {lp}") from None
    try:
        fd = _open_fd(name, lp, dir_fd=dfd, hop=True)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as lf:
        yield lf


def read_at_most(f: BinaryIO, limit: int, where: str, head: bytes = b"") -> bytes:
    """``head`` (what was read of ``f`` already) and the rest of ``f``, if that
    is at most ``limit`` bytes in all, else a :class:`CorruptionError`."""
    data = head + f.read(limit - len(head) + 1)
    if len(data) > limit:
        raise CorruptionError(f"{where}: more than the {limit} bytes allowed for a pointer file")
    return bytes(data)


def read_pointer(path: PATH, *, max_bytes: int = pointer_cap(DEFAULT_MAX_INLINE_BYTES)) -> dict[str, Any]:
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
    if blake3.blake3(canonical_json(doc["inline"])).hexdigest() != doc["inline_digest"]:
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


def pointer_auth_problem(auth: RecordAuth, doc: Mapping[str, Any]) -> str | None:
    """None if the pointer is tagged with the run's key (or the policy is off), else why not."""
    if auth.policy is AuthPolicy.OFF:
        return None
    if auth.keyring is None:
        return "no key configured to check it"
    tag = AuthTag.parse(doc.get("auth"))
    return auth.keyring.check(POINTER_TAG_KIND, doc["run_id"], pointer_digest(doc), tag)


def is_detached(head: bytes) -> bool:
    return head.startswith(DETACHED_MAGIC)


def is_pending(head: bytes) -> bool:
    return head.startswith(PENDING_MAGIC)


def read_pending(f: BinaryIO, where: str) -> dict[str, Any]:
    """The fields of a reservation file (``f`` read past its magic line), parsed strictly."""
    raw = f.read(MAX_PENDING_BYTES + 1)
    if len(raw) > MAX_PENDING_BYTES:
        raise CorruptionError(f"{where}: more than the {MAX_PENDING_BYTES} bytes allowed for a reservation file")
    doc = decode_json(raw, where=where, max_bytes=MAX_PENDING_BYTES, canonical=True)
    if (not isinstance(doc, dict) or set(doc) != {"store", "run_id", "step"} or not isinstance(doc["store"], str)
            or not isinstance(doc["run_id"], str) or type(doc["step"]) is not int):
        raise CorruptionError(f"{where}: not a well-formed reservation file")
    return doc


def reservation_of(f: BinaryIO, where: str, own: tuple[str, str] | None) -> str | None:
    """None if ``f`` (read past its magic line) is a reservation for the run ``own`` (store URL,
    run ID), else why not (for :func:`remove_own_file`)."""
    try:
        doc = read_pending(f, where)
    except CorruptionError as exc:
        return f"not a file this plug-in wrote ({str(exc).removeprefix(where + ': ')})"
    if own is None or own != (doc["store"], doc["run_id"]):
        return "not a file this plug-in wrote (a reservation for another run)"
    return None


def reservation_not_a_checkpoint(f: BinaryIO, where: str) -> NotFoundError:
    """What loading a reservation (``f`` read past its magic line) raises: it holds no checkpoint."""
    doc = read_pending(f, where)
    return NotFoundError(
        f"{where}: no checkpoint here: the path was reserved by an asynchronous save of step {doc['step']} (run "
        f"{doc['run_id'][:64]!r}) that has not finished (it runs in another process, or that process stopped "
        "first); resume from another checkpoint "
        "file, or write a pointer to the run's newest complete save with "
        "ckptstore.integrations.lightning.write_pointer_for_latest"
    )


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


#: what ``remove_own_file``'s judge is asked: may the open file ``f`` at ``where`` go? ``inside``: the path
#: lies below one of the plug-in's checkpoint directories. None: it goes; else why not.
Judge = Callable[[BinaryIO, str, bool], "str | None"]


def remove_own_file(path: PATH, mine: Judge, options: Mapping[str, Any] | None = None,
                    dirs: CheckpointDirs | None = None) -> str | None:
    """Remove the file at ``path`` if ``mine(file, where, inside)`` says this
    plug-in wrote it (returns None); else keep it and return why. A path with a
    ``..`` component, a special file or a link is never removed -- except a
    sibling link (:func:`sibling_target`) to a file ``mine`` accepts: the link
    is removed, never its target; a missing file is nothing to do. ``inside``
    tells ``mine`` whether the path lies below one of ``dirs`` (then every
    component below that directory was opened without following a link, and a
    link there keeps the file). Local files are judged and unlinked through one
    directory descriptor, and only if the name still names the file judged."""
    p = os.fspath(path)
    if has_dotdot(p):
        return "its path contains '..'"
    inside = dirs is not None and dirs.root_of(p) is not None
    if is_remote(p):
        fs = filesystem(p, options)
        try:
            with fs.open(p, "rb") as f:
                why = mine(f, p, inside)
        except FileNotFoundError:
            return None
        if why is None:
            fs.rm(p)
        return why
    lp = key(p)
    try:
        dfd, name, _root = open_parent(p, dirs, CorruptionError)
    except FileNotFoundError:
        return None
    except CorruptionError as exc:
        return str(exc).removeprefix(f"{lp}: ")
    except OSError as exc:
        return f"its directory cannot be opened ({exc.strerror})"
    try:
        try:
            link = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        target = sibling_target(name, dfd) if stat.S_ISLNK(link.st_mode) else None
        try:
            fd = _open_fd(target if target is not None else name, lp, dir_fd=dfd)
        except FileNotFoundError:
            return None if target is None else f"it is a link to {target!r}, which is not there"
        except CorruptionError as exc:
            return str(exc).removeprefix(f"{lp}: ")
        judged = os.fstat(fd)
        with os.fdopen(fd, "rb") as f:
            why = mine(f, lp, inside)
        if why is not None:
            return why if target is None else f"it is a link to {target!r}, which is {why}"
        # a sibling link to a file of ours: the link goes, never its target
        now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if target is not None:
            if (now.st_dev, now.st_ino) != (link.st_dev, link.st_ino) or sibling_target(name, dfd) != target:
                return "it was replaced while being checked"
        elif (now.st_dev, now.st_ino) != (judged.st_dev, judged.st_ino):
            return "it was replaced while being checked"
        os.unlink(name, dir_fd=dfd)
        return None
    finally:
        os.close(dfd)


def load_detached(f: BinaryIO, where: str, key: bytes, registry: TypeRegistry | None, map_location: Any) -> dict[str, Any]:
    """The dict in a detached file this plug-in (or a spawned copy) wrote; never a training checkpoint."""
    doc_bytes, tensor_bytes = read_detached(f, where, key)
    doc = tree_from_json(doc_bytes)
    tensors = map_tensors(load_safetensors(tensor_bytes) if tensor_bytes else {}, map_location)
    out: dict[str, Any] = {}
    for i, name in enumerate(doc["keys"]):
        mine = {k.split("/", 1)[1]: t for k, t in tensors.items() if k.split("/", 1)[0] == str(i)}
        out[name] = unflatten(doc["trees"][name], mine, registry=registry)
    step = out.get("global_step")
    if isinstance(step, int) and not isinstance(step, bool):
        raise CorruptionError(f"{where}: a detached file with a global_step is not a training checkpoint")
    return out


# ------------------------------------------------------------------ what a pointer names


def named_save(store: CheckpointStore, ptr: Mapping[str, Any], where: str, auth: RecordAuth) -> SaveRef:
    """The commit the pointer names, the one it was written for, authenticated where required."""
    try:
        ref = store.get_save(ptr["step"], ptr["attempt"])
    except NotFoundError:
        raise CorruptionError(
            f"{where}: points to step {ptr['step']} attempt {ptr['attempt']} of run "
            f"{ptr['run_id']!r} at {ptr['store']}, which has no such commit (collected by gc?)"
        ) from None
    if ref.save_id != ptr["save_id"] or ref.manifest_digest != ptr["manifest_digest"]:
        raise CorruptionError(
            f"{where}: the save's manifest digest is {ref.manifest_digest}, the pointer says "
            f"{ptr['manifest_digest']}; refusing to load"
        )
    if auth.policy is not AuthPolicy.OFF:
        report = store.verify(ref, deep=False)
        bad = [d for r, d in report.problems if r in (SkipReason.UNAUTHENTICATED, SkipReason.UNREADABLE_RECORD)]
        if bad:
            raise CorruptionError(
                f"{where}: the commit of step {ptr['step']} attempt {ptr['attempt']} is refused under "
                f"auth_policy={auth.policy.value!r}: {'; '.join(bad)}"
            )
    return ref


def check_inline(auth: RecordAuth, ptr: Mapping[str, Any], where: str) -> None:
    """Inline state is in no commit: only the pointer's tag (the run's key) vouches for it."""
    why = pointer_auth_problem(auth, ptr)
    if why is None:
        return
    keys = sorted(ptr["inline"])[:8]
    if auth.policy is AuthPolicy.WARN:
        warnings.warn(f"{where}: inline state {keys} used although {why}", UnauthenticatedWarning, stacklevel=3)
        return
    raise CorruptionError(
        f"{where}: the pointer carries state {keys} outside the store that is not authenticated ({why}); "
        "under auth_policy='require' only pointers tagged with the run's key carry state — "
        "write a fresh pointer to the save (write_pointer_for_latest) or load a save's own pointer"
    )
