"""The files of the Hugging Face callback: a ``checkpoint-N`` directory read for
publishing and written back on restore, no link ever followed.

Only ``checkpoint-<int>`` with ASCII digits in their one canonical spelling
(``checkpoint-7``, not ``checkpoint-07``, ``checkpoint-٧`` or ``checkpoint-x``)
names a checkpoint directory (:func:`checkpoint_step`).

Reading (:class:`CheckpointTree`): the directory is opened with
``O_NOFOLLOW | O_DIRECTORY`` relative to its parent (the output directory: the
operator's configuration, opened as given) and walked iteratively from that
descriptor, each subdirectory opened relative to its parent, never by path.
Each file is opened relative to its directory with ``O_NOFOLLOW | O_NONBLOCK``,
checked with ``fstat`` (a regular file, the inode the listing saw) and read up
to the size the listing saw, no further. A symbolic link (to a file or to a
directory), FIFO, socket or device anywhere in the tree is refused with an
:class:`~ckptstore.errors.InvalidInputError` that names its path: the
directory is not published at all (a skip would publish a checkpoint that
restores without one of its files). Hard links are read as the file they are
(the kernel's ``protected_hardlinks`` lets nobody link a file they could not
read themselves).

Writing (:func:`write_tree`): into a directory created exclusively (``mkdir``
fails on anything already there, a planted link included), every
subdirectory created exclusively relative to its parent's descriptor and every
file with ``O_CREAT | O_EXCL | O_NOFOLLOW``, fsynced, then every directory
fsynced; the caller renames the finished directory into place.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType

import blake3

from ..errors import InvalidInputError
from ..protocol import is_component_name
from ..protocol.layout import MAX_STEP
from ..protocol.records import MAX_COMPONENTS

#: The deepest directory nesting accepted inside a checkpoint directory (the Trainer writes one or two levels).
MAX_DEPTH = 32
BLOCK = 1 << 20

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRFLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
_READFLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_CREATEFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
# [0-9] is ASCII whatever the flags; no leading zero; at most as many digits as a step has
_CHECKPOINT_RE = re.compile(rf"checkpoint-(0|[1-9][0-9]{{0,{len(str(MAX_STEP)) - 1}}})")

__all__ = ["MAX_DEPTH", "CheckpointTree", "checkpoint_step", "write_tree"]


def checkpoint_step(name: str) -> int | None:
    """The step of a directory named ``checkpoint-<step>`` in its one canonical
    spelling (ASCII digits, no leading zero, no sign); None for any other name."""
    m = _CHECKPOINT_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP and f"checkpoint-{step}" == name else None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def _refuse(path: Path, what: str) -> InvalidInputError:
    return InvalidInputError(
        f"{path}: {what}; ckptstore publishes only regular files and real directories and never follows a link "
        "(a link could upload files from outside the checkpoint). Replace it with a copy of the file it names, "
        "or remove it, then save again"
    )


def _open_dir_at(parent: int, name: str, path: Path) -> int:
    try:
        return os.open(name, _DIRFLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            try:
                kind = _kind(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
            except OSError:
                kind = "not a directory"
            raise _refuse(path, f"a {kind} where a directory belongs") from None
        raise


class CheckpointTree:
    """An open checkpoint directory: its descriptor is held, and nothing below it
    is resolved by path again. Use as a context manager.

    Raises :class:`FileNotFoundError` when the directory does not exist and
    :class:`~ckptstore.errors.InvalidInputError` when it is a link or not a
    directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(directory))
        parent = os.open(self.path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        try:
            self._fd = _open_dir_at(parent, self.path.name, self.path)
        finally:
            os.close(parent)
        self._inodes: dict[str, tuple[int, int]] = {}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CheckpointTree:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def files(self) -> list[tuple[str, int]]:
        """Every regular file below the directory as (relative '/'-path, size), sorted.

        Refuses (:class:`~ckptstore.errors.InvalidInputError`, naming the path) a
        link or special file anywhere, a tree deeper than :data:`MAX_DEPTH` or
        with more files than a save can hold."""
        out: list[tuple[str, int]] = []
        stack: list[tuple[int, str, int]] = [(os.dup(self._fd), "", 0)]
        try:
            while stack:
                fd, prefix, depth = stack.pop()
                try:
                    with os.scandir(fd) as it:
                        entries = sorted(e.name for e in it)
                    for name in entries:
                        rel = prefix + name
                        path = self.path / rel
                        try:
                            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # gone since the listing
                        if stat.S_ISDIR(st.st_mode):
                            if depth + 1 >= MAX_DEPTH:
                                raise InvalidInputError(
                                    f"{path}: nested deeper than {MAX_DEPTH} directories below {self.path}; "
                                    "not a checkpoint this callback publishes"
                                )
                            stack.append((_open_dir_at(fd, name, path), rel + "/", depth + 1))
                        elif stat.S_ISREG(st.st_mode):
                            if len(out) >= MAX_COMPONENTS:
                                raise InvalidInputError(
                                    f"{self.path}: more than {MAX_COMPONENTS} files, more than one save can hold"
                                )
                            out.append((rel, st.st_size))
                            self._inodes[rel] = (st.st_dev, st.st_ino)
                        else:
                            raise _refuse(path, f"a {_kind(st.st_mode)}")
                finally:
                    os.close(fd)
        finally:
            for fd, _, _ in stack:
                os.close(fd)
        out.sort()
        return out

    def _open(self, rel: str) -> int:
        parts = rel.split("/")
        path = self.path / rel
        if not is_component_name(rel):
            raise InvalidInputError(f"{path}: not a file name this callback reads")
        d = os.dup(self._fd)
        try:
            for i, part in enumerate(parts[:-1]):
                nxt = _open_dir_at(d, part, self.path / "/".join(parts[: i + 1]))
                os.close(d)
                d = nxt
            before = os.stat(parts[-1], dir_fd=d, follow_symlinks=False)
            if not stat.S_ISREG(before.st_mode):
                raise _refuse(path, f"a {_kind(before.st_mode)}")
            try:
                fd = os.open(parts[-1], _READFLAGS, dir_fd=d)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _refuse(path, "a symbolic link") from None
                raise
        finally:
            os.close(d)
        st = os.fstat(fd)
        listed = self._inodes.get(rel)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or (
            listed is not None and listed != (st.st_dev, st.st_ino)
        ):
            os.close(fd)
            raise _refuse(path, "replaced while it was being read")
        return fd

    def blocks(self, rel: str, size: int) -> Iterator[bytes]:
        """The ``size`` bytes of a listed file, in blocks; a file that is shorter or
        longer by the end is :class:`~ckptstore.errors.InvalidInputError` (it
        changed while it was being published)."""
        fd = self._open(rel)
        try:
            got = 0
            while got < size:
                block = os.pread(fd, min(BLOCK, size - got), got)
                if not block:
                    break
                got += len(block)
                yield block
            if got != size or os.pread(fd, 1, got):
                raise InvalidInputError(
                    f"{self.path / rel}: changed while it was being read (listed with {size} bytes); "
                    "save again once nothing else writes to the checkpoint directory"
                )
        finally:
            os.close(fd)

    def digest(self, rel: str, size: int) -> str:
        """BLAKE3 (hex) of a listed file's bytes, read as :meth:`blocks` reads them."""
        h = blake3.blake3()
        for block in self.blocks(rel, size):
            h.update(block)
        return h.hexdigest()


def write_tree(parent: str | os.PathLike[str], name: str, files: Iterable[tuple[str, Iterable[bytes]]]) -> None:
    """Create ``parent/name`` (which must not exist) and write each (relative
    '/'-path, blocks) into it, no link followed; files and directories fsynced.
    Relative paths must be valid component names (no ``..``, no empty or
    dot-led segment). On an error the partial directory is left for the
    caller to remove."""
    top = Path(os.path.abspath(parent))
    pfd = os.open(top, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    dirs: dict[str, int] = {}
    try:
        os.mkdir(name, 0o777, dir_fd=pfd)  # exclusive: anything already there (a link too) is EEXIST
        dirs[""] = _open_dir_at(pfd, name, top / name)
        for rel, blocks in files:
            if not is_component_name(rel):
                raise InvalidInputError(f"{rel[:120]!r}: not a file name a checkpoint directory can hold")
            parts = rel.split("/")
            here = ""
            for part in parts[:-1]:
                sub = f"{here}/{part}" if here else part
                if sub not in dirs:
                    os.mkdir(part, 0o777, dir_fd=dirs[here])
                    dirs[sub] = _open_dir_at(dirs[here], part, top / name / sub)
                here = sub
            fd = os.open(parts[-1], _CREATEFLAGS, 0o666, dir_fd=dirs[here])
            try:
                with os.fdopen(os.dup(fd), "wb") as f:
                    f.writelines(blocks)
                    f.flush()
                os.fsync(fd)
            finally:
                os.close(fd)
        # fsync through the descriptors opened without following a link (util.files works by name)
        for fd in dirs.values():
            os.fsync(fd)
    finally:
        for fd in dirs.values():
            os.close(fd)
        os.close(pfd)
