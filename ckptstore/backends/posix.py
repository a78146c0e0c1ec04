"""The system calls of the local backend, resolved without following links.

:class:`PosixOps` is what :class:`~ckptstore.backends.local.LocalBackend`
calls for every file-system operation (the power-loss tests substitute a
simulated file system). Below the store root nothing is followed: see the
class docstring and protocol_spec/THREATS.md §3.1.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..util import files as durable
from .base import MAX_KEY_DEPTH, Buffer, too_deep


class NotFollowedError(NotADirectoryError):
    """A path below the store root runs through a symbolic link (or a
    non-directory where a directory belongs). The local backend never follows
    one: the key does not name an object inside the store."""


class NotAnObjectError(OSError):
    """The entry at a key is not a regular file (a symbolic link, FIFO, device
    or socket). It is never opened for reading nor reported as an object."""


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRFLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700


class PosixOps:
    """The system calls the local backend uses; replaceable for fault injection.

    Paths *below* the attached root are resolved component by component from a
    descriptor of the root (``openat`` style, ``O_NOFOLLOW`` on every step), so
    a symbolic link planted anywhere inside the store is never followed — not
    by a read, a write, a listing or a delete — and no path can leave the root.
    The root itself (and anything above it) is the operator's configuration and
    is opened as given. Only regular files are objects: a FIFO, device, socket
    or link at a key raises :class:`NotAnObjectError` and is never read.
    New files get ``file_mode`` and directories ``dir_mode`` (the umask still
    applies; it can only remove permissions).
    """

    root_anchor: str | None = None
    file_mode: int = DEFAULT_FILE_MODE
    dir_mode: int = DEFAULT_DIR_MODE

    def attach(self, root: str, *, file_mode: int = DEFAULT_FILE_MODE, dir_mode: int = DEFAULT_DIR_MODE) -> None:
        """Bind to the store root: below it nothing is followed."""
        self.root_anchor = os.path.abspath(root)
        self.file_mode = file_mode
        self.dir_mode = dir_mode

    # -- no-follow path resolution -----------------------------------------
    def _below(self, path: str) -> list[str] | None:
        """The components of ``path`` below the root, or None for the root
        itself and paths outside it (trusted configuration, opened as given)."""
        anchor = self.root_anchor
        if anchor is None:
            return None
        path = os.path.abspath(path)
        if path == anchor or not path.startswith(anchor.rstrip(os.sep) + os.sep):
            return None
        return path[len(anchor.rstrip(os.sep)) + 1 :].split(os.sep)

    def _open_dir(self, parts: Sequence[str], path: str) -> int:
        """A descriptor of root/parts[0]/…, no link followed on the way."""
        assert self.root_anchor is not None
        fd = os.open(self.root_anchor, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        try:
            for part in parts:
                if part in ("", ".", ".."):
                    raise NotFollowedError(errno.EINVAL, "path component not allowed below the store root", path)
                try:
                    nxt = os.open(part, _DIRFLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                        raise NotFollowedError(
                            errno.ELOOP, f"{part!r} is a symbolic link or not a directory; not followed", path
                        ) from None
                    raise
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_directory(self, path: str) -> int:
        """A descriptor of the real directory at ``path``: the root itself (opened
        as given), or a directory below it reached component by component with
        ``O_NOFOLLOW | O_DIRECTORY`` from the root's descriptor. A link (or a
        non-directory) anywhere below the root is :class:`NotFollowedError`, a
        missing component ``FileNotFoundError``, a path outside the root
        :class:`NotFollowedError` too. The caller closes the descriptor. (For
        other users of the no-follow rule, e.g. the Lightning plug-in's
        checkpoint directories.)"""
        anchor = self.root_anchor
        if anchor is None:
            raise NotFollowedError(errno.EINVAL, "no root attached", path)
        parts = [] if os.path.abspath(path) == anchor else self._below(path)
        if parts is None:
            raise NotFollowedError(errno.EXDEV, "not below the root", path)
        return self._open_dir(parts, path)

    @contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str]]:
        """(descriptor of the parent directory, final name) for a path below the root."""
        parts = self._below(path)
        assert parts is not None
        fd = self._open_dir(parts[:-1], path)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def _lstat(self, path: str) -> os.stat_result:
        if self._below(path) is None:
            return os.lstat(path)
        with self._parent(path) as (d, name):
            return os.stat(name, dir_fd=d, follow_symlinks=False)

    # -- mutating ----------------------------------------------------------
    def open_new(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        if self._below(path) is None:
            return os.open(path, flags, self.file_mode)
        with self._parent(path) as (d, name):
            return os.open(name, flags, self.file_mode, dir_fd=d)

    def write(self, fd: int, buf: Buffer) -> None:
        view = memoryview(buf).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        with self._parent(src) as (sd, sn), self._parent(dst) as (dd, dn):
            os.rename(sn, dn, src_dir_fd=sd, dst_dir_fd=dd)

    def link(self, src: str, dst: str) -> None:
        with self._parent(src) as (sd, sn), self._parent(dst) as (dd, dn):
            os.link(sn, dn, src_dir_fd=sd, dst_dir_fd=dd, follow_symlinks=False)

    def unlink(self, path: str) -> None:
        """Removes the entry itself (a link, never its target)."""
        with self._parent(path) as (d, name):
            os.unlink(name, dir_fd=d)

    def mkdir(self, path: str) -> None:
        if self._below(path) is None:
            os.mkdir(path, self.dir_mode)
            return
        with self._parent(path) as (d, name):
            os.mkdir(name, self.dir_mode, dir_fd=d)

    def rmdir(self, path: str) -> None:
        with self._parent(path) as (d, name):
            os.rmdir(name, dir_fd=d)

    def fsync_dir(self, path: str) -> None:
        parts = self._below(path)
        if parts is None:  # above the store's root: by name, as everywhere else
            durable.fsync_dir(path)
            return
        # below the root: through the no-follow chain of directory descriptors, so a
        # directory swapped for a link is never resolved (util.files works by name)
        fd = self._open_dir(parts, path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reading -----------------------------------------------------------
    def _open_regular(self, path: str) -> tuple[int, os.stat_result]:
        """A descriptor of the regular file at ``path`` (and its ``fstat``);
        a link, FIFO, device or socket is :class:`NotAnObjectError`, never opened."""
        with self._parent(path) as (d, name):
            before = os.stat(name, dir_fd=d, follow_symlinks=False)
            if not stat.S_ISREG(before.st_mode):
                raise NotAnObjectError(errno.EINVAL, f"not a regular file ({_kind(before.st_mode)})", path)
            # O_NONBLOCK: should the entry be swapped for a FIFO after the check, opening it never hangs
            try:
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC, dir_fd=d)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise NotAnObjectError(errno.ELOOP, "not a regular file (symbolic link)", path) from None
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise NotAnObjectError(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})", path)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of a regular file (to its size at open when
        ``end`` is None); never more than asked, never from a non-file."""
        fd, st = self._open_regular(path)
        try:
            stop = st.st_size if end is None else min(end, st.st_size + 1)  # +1: a file that grew shows it
            want = max(0, stop - max(0, start))
            out = bytearray(want)
            got = _preadv_all(fd, memoryview(out), max(0, start))
            del out[got:]
            return bytes(out)
        finally:
            os.close(fd)

    def read_many(self, directory: str, names: Sequence[str], limit: int | Sequence[int]) -> list[bytes | None]:
        """The first ``limit`` bytes (one bound, or one per name) of each
        regular file ``names`` in ``directory`` (None: missing, or not a
        regular file), the directory resolved once (no link followed) and
        each file opened relative to it with the checks of :meth:`read`."""
        limits = [limit] * len(names) if isinstance(limit, int) else list(limit)
        if len(limits) != len(names):
            raise ValueError(f"read_many: {len(limits)} bounds for {len(names)} names")
        if type(self).read is not PosixOps.read or self._below(directory) is None:
            return [self._read_or_none(os.path.join(directory, n), m) for n, m in zip(names, limits, strict=True)]
        parts = self._below(directory)
        assert parts is not None
        try:
            d = self._open_dir(parts, directory)
        except (FileNotFoundError, NotADirectoryError):
            return [None] * len(names)
        try:
            return [self._read_at(d, n, m) for n, m in zip(names, limits, strict=True)]
        finally:
            os.close(d)

    def _read_or_none(self, path: str, limit: int) -> bytes | None:
        try:
            return self.read(path, 0, limit)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, NotAnObjectError):
            return None

    @staticmethod
    def _read_at(d: int, name: str, limit: int) -> bytes | None:
        if not name or name in (".", "..") or "/" in name:
            return None
        try:
            before = os.stat(name, dir_fd=d, follow_symlinks=False)
            if not stat.S_ISREG(before.st_mode):
                return None
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC, dir_fd=d)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                return None
            out = bytearray()
            while len(out) < limit:
                chunk = os.pread(fd, min(limit - len(out), 1 << 24), len(out))
                if not chunk:
                    break
                out += chunk
            return bytes(out)
        finally:
            os.close(fd)

    def readinto(self, path: str, start: int, out: memoryview) -> int:
        """Fill ``out`` with the file's bytes from ``start``, straight from the
        kernel (no intermediate copy); the count read (short at the end of the
        file). Same checks as :meth:`read`."""
        fd, _st = self._open_regular(path)
        try:
            return _preadv_all(fd, out, max(0, start))
        finally:
            os.close(fd)

    def stat(self, path: str) -> tuple[int, float]:
        """(size, mtime) of a regular file; anything else is :class:`NotAnObjectError`."""
        st = self._lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise NotAnObjectError(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})", path)
        return st.st_size, st.st_mtime

    def is_dir(self, path: str) -> bool:
        """A real directory (a link to one is not)."""
        if self._below(path) is None:
            return os.path.isdir(path)
        try:
            return stat.S_ISDIR(self._lstat(path).st_mode)
        except OSError:
            return False

    def exists(self, path: str) -> bool:
        if self._below(path) is None:
            return os.path.exists(path)
        try:
            self._lstat(path)
        except OSError:
            return False
        return True

    def walk(
        self, top: str, *, descend: bool = True, max_depth: int = MAX_KEY_DEPTH, prune_deep: bool = False
    ) -> Iterable[tuple[str, list[str], list[str]]]:
        """Like ``os.walk``, but: only real directories are entered (links to
        directories are not), and only regular files are reported. Names come
        from the directory entries' types: nothing is stat'ed. ``descend=False``:
        ``top`` alone. Iterative (one open directory per level); a directory
        with subdirectories at ``max_depth`` levels below ``top`` raises
        :class:`~ckptstore.errors.LimitReachedError` (``prune_deep``: they are
        not entered, for searches that nothing of ckptstore's lies below)."""
        depth = (max_depth if descend else 0, prune_deep)
        for path, dirs, files, _stats in self._walk_top(top, False, depth):
            yield path, dirs, files

    def walk_stat(
        self, top: str, *, descend: bool = True, max_depth: int = MAX_KEY_DEPTH
    ) -> Iterator[tuple[str, list[tuple[str, int, float]]]]:
        """(directory, [(file name, size, mtime), ...]) for every real directory
        under ``top``, as :meth:`walk` finds them: each regular file stat'ed
        with ``fstatat`` relative to its open directory, no link followed and
        no path resolved again from the root (an entry swapped for something
        else than a regular file since the listing is left out)."""
        if type(self).walk is not PosixOps.walk or type(self).stat is not PosixOps.stat:
            # a substituted file system (the power-loss simulator): compose its own calls
            for dirpath, _dirs, files in self.walk(top, descend=descend, max_depth=max_depth):
                found = []
                for f in files:
                    try:
                        found.append((f, *self.stat(os.path.join(dirpath, f))))
                    except (FileNotFoundError, NotADirectoryError, NotAnObjectError):
                        continue
                yield dirpath, found
            return
        for path, _dirs, files, stats in self._walk_top(top, True, (max_depth if descend else 0, False)):
            yield path, [(f, st[0], st[1]) for f, st in zip(files, stats, strict=True) if st[0] >= 0]

    def _walk_top(
        self, top: str, with_stat: bool, depth: tuple[int, bool]
    ) -> Iterator[tuple[str, list[str], list[str], list[tuple[int, float]]]]:
        parts = self._below(top)
        try:
            if parts is None:
                fd = os.open(top, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
            else:
                fd = self._open_dir(parts, top)
        except OSError:
            return
        yield from self._walk_fd(fd, os.path.abspath(top), with_stat, *depth)

    def _walk_fd(
        self, fd: int, path: str, with_stat: bool, max_depth: int, prune_deep: bool
    ) -> Iterator[tuple[str, list[str], list[str], list[tuple[int, float]]]]:
        """Depth first, top down, without recursion: ``stack`` holds the open
        directory of each level being walked (at most ``max_depth + 1``), each
        with the subdirectory names still to enter (those the caller left in
        ``dirs`` after seeing them). Subdirectories below ``max_depth`` raise,
        or are left out with ``prune_deep`` (``max_depth=0``: ``fd`` alone,
        its subdirectories are not entered)."""
        stack: list[tuple[int, str, Iterator[str]]] = [(fd, path, iter(()))]
        try:
            entered: str | None = path
            while stack:
                dfd, dpath, names = stack[-1]
                if entered is not None:
                    entered = None
                    dirs, files, stats = _scan(dfd, with_stat)
                    yield dpath, dirs, files, stats
                    deeper = max_depth > 0 and len(stack) <= max_depth
                    if dirs and max_depth > 0 and not deeper and not prune_deep:
                        raise too_deep(self.root_anchor or "", os.path.join(dpath, dirs[0]))
                    stack[-1] = (dfd, dpath, iter(list(dirs) if deeper else ()))
                    continue
                name = next(names, None)
                if name is None:
                    stack.pop()
                    os.close(dfd)
                    continue
                try:
                    sub = os.open(name, _DIRFLAGS, dir_fd=dfd)
                except OSError:
                    continue  # vanished, or swapped for a link since the listing
                entered = os.path.join(dpath, name)
                stack.append((sub, entered, iter(())))
        finally:
            for dfd, _p, _n in stack:
                os.close(dfd)


def _scan(fd: int, with_stat: bool) -> tuple[list[str], list[str], list[tuple[int, float]]]:
    """One directory's real subdirectories and regular files (with size and
    mtime when ``with_stat``), from its entries' types, nothing followed."""
    dirs: list[str] = []
    files: list[str] = []
    stats: list[tuple[int, float]] = []
    with os.scandir(fd) as it:
        for e in it:
            try:
                if e.is_dir(follow_symlinks=False):
                    dirs.append(e.name)
                elif e.is_file(follow_symlinks=False):
                    if with_stat:
                        st = e.stat(follow_symlinks=False)  # fstatat(fd, name, AT_SYMLINK_NOFOLLOW)
                        stats.append((st.st_size, st.st_mtime) if stat.S_ISREG(st.st_mode) else (-1, 0.0))
                    files.append(e.name)
            except OSError:
                continue
    return dirs, files, stats


def _preadv_all(fd: int, out: memoryview, offset: int) -> int:
    """``preadv`` until ``out`` is full or the file ends; the count read."""
    got = 0
    n = len(out)
    while got < n:
        k = os.preadv(fd, [out[got : min(n, got + (1 << 30))]], offset + got)
        if k == 0:
            break
        got += k
    return got


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"
