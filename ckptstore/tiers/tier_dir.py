"""The local tier's folders on disk (protocol_spec/THREATS.md §4.12,
``docs/tiers.md`` "What the tier refuses").

The tier's root (``local_tier=``) is the operator's configuration and is
opened as given, like a local store's root. Everything below it — a job's
rank folder ``rank-<r>``, the run's folder, ``.quarantine`` — is created and
opened without following links: through a
:class:`~ckptstore.backends.local.LocalBackend` anchored at the root (the
no-follow resolution of :class:`~ckptstore.backends.posix.PosixOps`), never
by a plain path. A link or non-directory where one of them belongs is
refused with :class:`~ckptstore.errors.LocalTierRefusedError` before
anything is written through it.

A tier whose run folder is the durable run's folder, lies inside it, or
holds it (a durable store on the same disk or on a shared file system) is
refused too: the tier's automatic retention would delete durable saves. The
folders are compared by device and inode, walking parent directories from
open descriptors, so no spelling of a path (``..``, links above, bind
mounts) hides the overlap.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from urllib.parse import urlparse
from urllib.request import url2pathname

from ..backends.local import LocalBackend, NotFollowedError, PosixOps
from ..errors import InvalidInputError, LocalTierRefusedError

#: Where a local run folder that is not this run's is moved (never a run ID: it starts with a dot).
QUARANTINE = ".quarantine"
#: Parent directories walked at most when comparing two folders (deeper: refused, never "apart").
MAX_ANCESTORS = 1024

_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

FileId = tuple[int, int]


#: The folder, inside a rank's folder, that holds the peer copies it received (never a run ID: a dot).
PEERS = ".peers"


def rank_folder(rank: int) -> str:
    """The name of rank ``rank``'s folder below a job's local tier root."""
    if rank < 0:
        raise ValueError("rank must be >= 0")
    return f"rank-{rank}"


def peer_folder(holder: int, sender: int) -> str:
    """The folder (relative to the job's local tier root) where rank
    ``holder`` keeps its peer copy of rank ``sender``'s parts:
    ``rank-<holder>/.peers/rank-<sender>``. It lies inside the holder's own
    rank folder, so it is lost with that node's disk and nothing of it can
    be mistaken for the holder's own saves (``.peers`` is never a run ID)."""
    if sender == holder:
        raise ValueError("a rank holds no peer copy of itself")
    return f"{rank_folder(holder)}/{PEERS}/{rank_folder(sender)}"


def _link_advice(path: str) -> str:
    return (f"remove {path} (or choose another local_tier): the local tier's folders below its root must be "
            "real directories; ckptstore never follows a link there")


def open_tier_dir(local_tier: str | os.PathLike[str], rank: int | None, *, create: bool = True,
                  folder: str | None = None) -> LocalBackend | None:
    """The local tier folder of one process (``rank`` None: ``local_tier``
    itself) or of rank ``rank`` of a job (``<local_tier>/rank-<r>``, or the
    relative ``folder`` given, e.g. a :func:`peer_folder`; resolved from
    ``local_tier`` without following a link at any of its components).
    ``create=False``: None when the folder does not exist (nothing is
    created). A link or non-directory there: :class:`LocalTierRefusedError`."""
    root = os.path.abspath(os.fspath(local_tier))
    if rank is None:
        if not create and not os.path.isdir(root):
            return None
        return LocalBackend(root, create_root=create)
    folder = os.path.join(root, *(folder or rank_folder(rank)).split("/"))
    probe = PosixOps()
    probe.attach(root)
    try:
        if probe.exists(folder) and not probe.is_dir(folder):
            raise NotFollowedError(folder)
        if not create and not probe.is_dir(folder):
            return None
    except (NotFollowedError, NotADirectoryError):  # a link (or a file) at the folder or at a folder above it
        raise LocalTierRefusedError(f"local tier {folder}: is (or lies below) a symbolic link or not a directory; "
                                    f"not opened, nothing written through it. {_link_advice(folder)}") from None
    try:
        return LocalBackend(folder, anchor=root, create_root=create)
    except (InvalidInputError, NotFollowedError):  # swapped for a link while it was created
        raise LocalTierRefusedError(f"local tier {folder}: is a symbolic link or not a directory; not opened, "
                                    f"nothing written through it. {_link_advice(folder)}") from None


def check_run_folder(backend: LocalBackend, run_id: str) -> None:
    """The run's folder in the tier, when present, is a real directory."""
    path = os.path.join(backend.root, run_id)
    if backend.ops.exists(path) and not backend.ops.is_dir(path):
        raise LocalTierRefusedError(f"local tier {backend.root}: the run's folder {path} is a symbolic link or "
                                    f"not a directory; not followed, nothing written. {_link_advice(path)}")


def durable_dir(url: str) -> str | None:
    """The directory of a durable store on a local or shared file system (a
    ``file://`` URL), else None (an object store cannot share a folder with
    the tier)."""
    if not url.startswith("file://"):
        return None
    return url2pathname(urlparse(url).path)


def _chain(fd: int) -> list[FileId]:
    """(device, inode) of the directory ``fd`` and of each parent up to ``/``
    (at most :data:`MAX_ANCESTORS`); ``fd`` is closed."""
    out: list[FileId] = []
    try:
        for _ in range(MAX_ANCESTORS):
            st = os.fstat(fd)
            here = (st.st_dev, st.st_ino)
            if out and out[-1] == here:  # '..' of '/' is '/'
                return out
            out.append(here)
            up = os.open("..", _DIR, dir_fd=fd)
            os.close(fd)
            fd = up
    finally:
        os.close(fd)
    raise LocalTierRefusedError(f"a folder more than {MAX_ANCESTORS} levels deep cannot be compared with the "
                                "durable store's; choose a local_tier nearer the file system's root")


def _open_below(parent: int, name: str) -> int | None:
    """A descriptor of the real directory ``name`` in ``parent`` (no link followed), or None."""
    try:
        fd = os.open(name, _DIR | _NOFOLLOW, dir_fd=parent)
    except OSError:
        return None
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _ids(top: str, run_id: str, nofollow: bool) -> tuple[FileId | None, FileId | None, list[FileId]]:
    """(id of ``top``, id of its run folder, the chain from the run folder — or
    from ``top`` when it has none — to ``/``). A ``top`` that does not exist
    yet: (None, None, the chain of its nearest existing parent)."""
    try:
        fd = os.open(top, _DIR | (_NOFOLLOW if nofollow else 0))
    except FileNotFoundError:
        p = top
        for _ in range(MAX_ANCESTORS):
            p = os.path.dirname(p)
            try:
                return None, None, _chain(os.open(p, _DIR))
            except FileNotFoundError:
                continue
        raise
    try:
        st = os.fstat(fd)
        top_id = (st.st_dev, st.st_ino)
        sub = _open_below(fd, run_id)
        if sub is None:
            return top_id, None, _chain(os.dup(fd))
        st = os.fstat(sub)
        return top_id, (st.st_dev, st.st_ino), _chain(sub)
    finally:
        os.close(fd)


def check_apart(tier: str | os.PathLike[str], run_id: str, durable_url: str, anchored: bool) -> None:
    """Refuse a tier folder ``tier`` whose run folder is the durable run's
    folder, is inside it, or holds it (compared by device and inode; a tier
    folder not created yet is judged by its nearest existing parent, so the
    check runs before anything is created). ``anchored``: ``tier`` is a rank
    folder below the operator's root (its last component is not followed)."""
    d = durable_dir(durable_url)
    if d is None:
        return
    where = os.path.abspath(os.fspath(tier))
    try:
        tier_id, tier_run, tier_chain = _ids(where, run_id, anchored)
        durable_id, durable_run, durable_chain = _ids(d, run_id, False)
    except LocalTierRefusedError:
        raise
    except OSError as exc:
        raise LocalTierRefusedError(f"local tier {where}: cannot be compared with the durable store {d} "
                                    f"({exc.strerror}); check both folders (remove any link there) and open "
                                    "again") from None
    why = None
    if tier_id is not None and tier_id == durable_id:
        why = "is the durable store's own folder (its run folder would be the durable run's)"
    elif durable_run is not None and durable_run in tier_chain:
        why = "lies inside the durable run's folder (or its run folder is that folder)"
    elif tier_run is not None and tier_run in durable_chain:
        why = "holds the durable run's folder inside its run folder"
    if why is not None:
        raise LocalTierRefusedError(
            f"local tier {where} {why} ({d}): the tier's retention would delete durable saves. Nothing was "
            "written. Choose another local_tier, on this machine's own disk outside the durable store "
            "(and remove any link that points it there)")


def quarantine_run_folder(backend: LocalBackend, run_id: str) -> str | None:
    """Move the tier's run folder into ``<tier>/.quarantine/`` (evidence, never
    deleted), created and entered without following links; the new path, or
    None when there was nothing to move. A move that cannot be done (a link
    or non-directory at ``.quarantine``, another file system, no permission)
    is :class:`LocalTierRefusedError` naming what to do; nothing is moved."""
    ops = backend.ops
    src = os.path.join(backend.root, run_id)
    if not ops.exists(src):
        return None
    qdir = os.path.join(backend.root, QUARANTINE)
    fix = f"move {src} out of the local tier by hand (or remove it), then open again"
    try:
        try:
            ops.mkdir(qdir)
            ops.fsync_dir(backend.root)
        except FileExistsError:
            pass
        if not ops.is_dir(qdir):
            raise LocalTierRefusedError(
                f"local tier {backend.root}: its run folder must be set aside, but {qdir} is a symbolic link or not "
                f"a directory (never followed): {_link_advice(qdir)}; or {fix}")
        dest = os.path.join(qdir, f"{run_id}-{time.time_ns()}")
        ops.rename(src, dest)
        ops.fsync_dir(qdir)
        ops.fsync_dir(backend.root)
    except NotFollowedError:
        raise LocalTierRefusedError(
            f"local tier {backend.root}: its run folder must be set aside, but {qdir} is a symbolic link or not a "
            f"directory (never followed): {_link_advice(qdir)}; or {fix}") from None
    except OSError as exc:
        what = "it is on another file system" if exc.errno == errno.EXDEV else (exc.strerror or str(exc))
        raise LocalTierRefusedError(
            f"local tier {backend.root}: its run folder {src} must be set aside (it is not this run's), but it "
            f"cannot be moved into {qdir} ({what}); {fix}") from None
    return dest
