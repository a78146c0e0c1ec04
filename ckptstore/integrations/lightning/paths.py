"""Where the Lightning plug-in reads, writes and removes its files: below its
*checkpoint directories*, no link followed (``protocol_spec/THREATS.md`` §4.5).

A checkpoint directory is a directory the plug-in wrote a pointer, detached or
reservation file into, as Lightning named it (``ModelCheckpoint(dirpath=...)``,
``trainer.save_checkpoint(path)``: the operator's configuration, opened as
given, like a store's root). Lightning removes a file only after saving into
the same ``dirpath``, so every removal it asks for names a path below one.
Below a checkpoint directory every component is opened relative to its
parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY`` (the local backend's
resolution, :meth:`~ckptstore.backends.posix.PosixOps.open_directory`): a
link anywhere in the path, a linked intermediate directory included, is
refused. A path below no checkpoint directory (the ``ckpt_path`` a resume
starts from, before any save) has its directory opened as given and only its
final name judged without following a link.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from typing import Any

from ...backends.posix import NotFollowedError, PosixOps
from ...errors import CkptStoreError

_DIRFLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path.removeprefix("file://")


def key(path: str) -> str:
    """The spelling of a path the checkpoint directories are compared in: an
    absolute local path (``..`` resolved lexically), or the URL as given
    (without a trailing ``/``)."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(local_path(path))


def _parent_key(path: str) -> str:
    k = key(path)
    return k.rsplit("/", 1)[0] if is_remote(path) else os.path.dirname(k)


class CheckpointDirs:
    """The checkpoint directories of one plug-in (and its pickled copies):
    thread-safe, noted as files are written."""

    def __init__(self) -> None:
        self._roots: set[str] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"roots": self.roots()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._roots = set(state["roots"])
        self._lock = threading.Lock()

    def root_of(self, path: str) -> str | None:
        """The most specific checkpoint directory ``path`` lies below (its own
        directory or one above it), or None."""
        k = key(path)
        sep = "/" if is_remote(path) else os.sep
        with self._lock:
            roots = tuple(self._roots)
        below = [r for r in roots if k.startswith(r.rstrip(sep) + sep)]
        if not below:
            return None
        root = max(below, key=len)
        rest = k[len(root.rstrip(sep)) + 1 :].split(sep)
        return root if all(part not in ("", ".", "..") for part in rest) else None

    def roots(self) -> list[str]:
        """The checkpoint directories, sorted."""
        with self._lock:
            return sorted(self._roots)

    def note(self, path: str) -> None:
        """``path`` was written: its directory is a checkpoint directory (unless one holds it already)."""
        if self.root_of(path) is None:
            with self._lock:
                self._roots.add(_parent_key(path))


def refusal(path: str, root: str, exc: OSError) -> str:
    """Why ``path``, through a link below the checkpoint directory ``root``, is refused, and the fix."""
    return (
        f"{path}: {exc.strerror or 'not followed'}, below the checkpoint directory {root}; the plug-in never "
        "follows a link inside a directory it saves checkpoints into (a planted link could make it read, write "
        "or remove a file outside): replace the link with a real directory, or name the real directory in "
        "ModelCheckpoint(dirpath=...)"
    )


def outside(roots: list[str]) -> str:
    """Why a pointer or reservation below none of the checkpoint directories ``roots`` is not removed."""
    named = ", ".join(roots[:3]) + (f" and {len(roots) - 3} more" if len(roots) > 3 else "") if roots else "none yet"
    return ("not a file this plug-in wrote there: the path is below none of the directories this plug-in "
            f"saved checkpoints into ({named}); a pointer names its run, not where it was written, so only "
            "pointers inside those directories are removed (Lightning removes files of its ModelCheckpoint "
            "dirpath after saving there)")


def open_parent(
    path: str, dirs: CheckpointDirs | None, error: type[CkptStoreError], *, create: bool = False
) -> tuple[int, str, str | None]:
    """(a descriptor of the directory of the local ``path``, its final name, the
    checkpoint directory it lies below or None). Below a checkpoint directory
    every component is opened no-follow from that directory's descriptor
    (``create``: missing ones are made, relative to their parent); a link or
    non-directory there is ``error`` (a :class:`~ckptstore.errors.CorruptionError`
    when reading, an :class:`~ckptstore.errors.InvalidInputError` when writing)
    naming the path and the fix. Otherwise the directory is
    opened as given (``create``: made as ``os.makedirs`` makes it). A missing
    directory is ``FileNotFoundError``. The caller closes the descriptor."""
    lp = key(path)
    d, name = os.path.split(lp)
    root = dirs.root_of(path) if dirs is not None else None
    if root is None:
        if create:
            os.makedirs(d, exist_ok=True)
        return os.open(d, _DIRFLAGS), name, None
    ops = PosixOps()
    ops.attach(root, file_mode=0o666, dir_mode=0o777)
    try:
        if create:
            rest = d[len(root.rstrip(os.sep)) + 1 :].split(os.sep) if d != root else []
            for i in range(1, len(rest) + 1):
                sub = os.path.join(root, *rest[:i])
                try:
                    os.close(ops.open_directory(sub))
                except FileNotFoundError:
                    try:
                        ops.mkdir(sub)
                    except FileExistsError:
                        pass  # made meanwhile: opened (no-follow) below
        return ops.open_directory(d), name, root
    except NotFollowedError as exc:
        raise error(refusal(lp, root, exc)) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise error(refusal(lp, root, exc)) from None
        raise


def has_dotdot(path: str) -> bool:
    return ".." in re.split(r"[/\\]", path)
