"""Local POSIX backend.

Durability order (the power-loss tests replay every allowed loss of un-synced
state against it):

* ``put``: write ``<dir>/.<name>.ckpt-tmp-<rand>``, fsync it, ``rename`` it to
  the final name, fsync the directory. Used for components only, whose keys are
  unique per save, so the rename never replaces anything that matters.
* ``create`` (commit records, run and attempt records): write and fsync a temp
  file, ``link(tmp, final)`` — which fails with EEXIST if the final name exists,
  so an existing record is never replaced (``rename`` would silently replace
  it) — unlink the temp file, fsync the directory.
* New directories are fsynced into their parent before anything is written in
  them, so a durable file never hangs off a lost directory entry.

Hostile contents (someone else can write into the store directory): below
the store root nothing is followed. Every path is resolved from a descriptor
of the root one component at a time with ``O_NOFOLLOW`` (``openat`` style,
race-free), so a symbolic link planted in a run's tree is never read through,
written through, listed into or deleted through — a key whose path crosses a
link is "not an object" for reads and an error for writes and deletes. Only
regular files are objects: a FIFO, device, socket or link at a key is skipped
by listings and refused by reads without being opened for data (``lstat``,
then ``open(O_NOFOLLOW | O_NONBLOCK)`` and an ``fstat`` check that it is the
same regular file). Reads never return more than asked. Files are created
``0o600`` and directories ``0o700`` unless ``file_mode`` / ``dir_mode`` say
otherwise (``storage_options={"file_mode": 0o640, "dir_mode": 0o750}``).

All system calls go through :class:`PosixOps` so a test can substitute a
filesystem that simulates power loss.
"""

from __future__ import annotations

import builtins
import errno
import os
import stat
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError, NotFoundError, StoreUnavailableError
from ..protocol.layout import RESERVED_MARK as TMP_MARK
from ..redact import redact_text
from .base import Backend, Buffer, Capabilities, ObjectInfo, check_key


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
        if parts is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        else:
            fd = self._open_dir(parts, path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reading -----------------------------------------------------------
    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of a regular file (to its size at open when
        ``end`` is None); never more than asked, never from a non-file."""
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
            stop = st.st_size if end is None else end
            want = max(0, stop - max(0, start))
            out = bytearray()
            off = max(0, start)
            while len(out) < want:
                chunk = os.pread(fd, min(want - len(out), 1 << 24), off)
                if not chunk:
                    break
                out += chunk
                off += len(chunk)
            return bytes(out)
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

    def walk(self, top: str) -> Iterable[tuple[str, list[str], list[str]]]:
        """Like ``os.walk``, but: only real directories are entered (links to
        directories are not), and only regular files are reported."""
        parts = self._below(top)
        try:
            if parts is None:
                fd = os.open(top, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
            else:
                fd = self._open_dir(parts, top)
        except OSError:
            return
        yield from self._walk_fd(fd, os.path.abspath(top))

    def _walk_fd(self, fd: int, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        try:
            dirs: list[str] = []
            files: list[str] = []
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            dirs.append(e.name)
                        elif e.is_file(follow_symlinks=False):
                            files.append(e.name)
                    except OSError:
                        continue
            yield path, dirs, files
            for name in dirs:
                try:
                    sub = os.open(name, _DIRFLAGS, dir_fd=fd)
                except OSError:
                    continue  # vanished, or swapped for a link since the listing
                yield from self._walk_fd(sub, os.path.join(path, name))
        finally:
            os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


class LocalBackend(Backend):
    capabilities = Capabilities(atomic_create=True, consistent_list=True)

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        ops: PosixOps | None = None,
        create_root: bool = True,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
    ) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = Path(self.root).as_uri()
        self.ops = ops or PosixOps()
        self.ops.attach(self.root, file_mode=_mode("file_mode", file_mode), dir_mode=_mode("dir_mode", dir_mode))
        if self.ops.exists(self.root) and not self.ops.is_dir(self.root):
            raise InvalidInputError(f"{self.root}: exists and is not a directory")
        if create_root:
            try:
                self._makedirs(self.root)
            except PermissionError as exc:
                raise StoreUnavailableError(f"{self.root}: cannot create the store directory ({exc.strerror})") from None

    # -- helpers ---------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _makedirs(self, path: str) -> None:
        """Create missing directories, each fsynced into its parent."""
        missing = []
        p = path
        while not self.ops.is_dir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        for d in reversed(missing):
            try:
                self.ops.mkdir(d)
            except FileExistsError:
                if not self.ops.is_dir(d):
                    if d == self.root or not d.startswith(self.root):
                        raise InvalidInputError(f"{d}: exists and is not a directory") from None
                    raise NotFollowedError(errno.ELOOP, "a symbolic link or non-directory is in the way", d) from None
                continue
            self.ops.fsync_dir(os.path.dirname(d))

    def _write_tmp(self, final: str, chunks: Iterable[Buffer]) -> str:
        d, name = os.path.split(final)
        self._makedirs(d)
        tmp = os.path.join(d, f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        fd = self.ops.open_new(tmp)
        try:
            for c in chunks:
                self.ops.write(fd, c)
            self.ops.fsync(fd)
        except BaseException:
            self.ops.close(fd)
            self._unlink_quiet(tmp)
            raise
        self.ops.close(fd)
        return tmp

    def _unlink_quiet(self, path: str) -> None:
        try:
            self.ops.unlink(path)
        except OSError:
            pass

    def _os_error(self, exc: OSError, key: str) -> Exception:
        if isinstance(exc, NotFollowedError | NotAnObjectError):
            return StoreUnavailableError(
                f"{self.root}: refusing to write {key!r}: {exc.strerror} at {self._rel(exc.filename)!r} "
                "(the local backend never follows links inside the store; remove it by hand)"
            )
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreUnavailableError(f"{self.root}: no space left while writing {key!r}")
        if isinstance(exc, PermissionError):
            return StoreUnavailableError(f"{self.root}: permission denied writing {key!r}")
        return StoreUnavailableError(redact_text(f"{self.root}: I/O error on {key!r}: {exc}"))

    # -- interface -------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, None)

    def get_range(self, key: str, start: int, end: int | None) -> bytes:
        try:
            return self.ops.read(self._path(key), start, end)
        except (NotFollowedError, NotAnObjectError) as exc:
            raise NotFoundError(f"{self.url}/{key}: not an object: {exc.strerror} (never read)") from None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFoundError(f"{self.url}/{key}: no such object") from None

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        final = self._path(key)
        try:
            tmp = self._write_tmp(final, chunks)
            self.ops.rename(tmp, final)
            self.ops.fsync_dir(os.path.dirname(final))
        except OSError as exc:
            raise self._os_error(exc, key) from exc

    def create(self, key: str, data: bytes) -> bool:
        final = self._path(key)
        try:
            tmp = self._write_tmp(final, [data])
            try:
                self.ops.link(tmp, final)
            except FileExistsError:
                return False
            finally:
                self._unlink_quiet(tmp)
            self.ops.fsync_dir(os.path.dirname(final))
            return True
        except OSError as exc:
            raise self._os_error(exc, key) from exc

    def list(self, prefix: str) -> list[ObjectInfo]:
        # prefix may end mid-name; walk the deepest existing directory.
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._path(base_key) if base_key else self.root
        out: list[ObjectInfo] = []
        if not self.ops.is_dir(top):
            return out
        for dirpath, _dirs, files in self.ops.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root)
            for f in files:
                if TMP_MARK in f:
                    continue
                key = f if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{f}"
                if not key.startswith(prefix):
                    continue
                try:
                    size, mtime = self.ops.stat(os.path.join(dirpath, f))
                except (FileNotFoundError, NotADirectoryError, NotAnObjectError):
                    continue  # vanished, or not a regular file: not an object
                out.append(ObjectInfo(key, size, mtime))
        out.sort(key=lambda o: o.key)
        return out

    def size(self, key: str) -> int:
        try:
            return self.ops.stat(self._path(key))[0]
        except (NotFollowedError, NotAnObjectError) as exc:
            raise NotFoundError(f"{self.url}/{key}: not an object: {exc.strerror}") from None
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.url}/{key}: no such object") from None

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.ops.unlink(path)
        except FileNotFoundError:
            return
        except NotFollowedError as exc:
            raise StoreUnavailableError(
                f"{self.root}: refusing to delete {key!r}: {exc.strerror} at {self._rel(exc.filename)!r}; "
                "nothing outside the store was touched (remove the link by hand)"
            ) from None
        except OSError as exc:
            raise self._os_error(exc, key) from exc
        # prune now-empty directories up to the root (best effort)
        d = os.path.dirname(path)
        while d != self.root and d.startswith(self.root):
            try:
                self.ops.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)
        self._fsync_dir_quiet(os.path.dirname(path) if self.ops.is_dir(os.path.dirname(path)) else d)

    def _fsync_dir_quiet(self, d: str) -> None:
        try:
            self.ops.fsync_dir(d)
        except OSError:
            pass

    def list_incomplete(self, prefix: str, older_than: float) -> builtins.list[str]:
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._path(base_key) if base_key else self.root
        out: builtins.list[str] = []
        if not self.ops.is_dir(top):
            return out
        for dirpath, _dirs, files in self.ops.walk(top):
            for f in files:
                if TMP_MARK not in f:
                    continue
                path = os.path.join(dirpath, f)
                try:
                    _size, mtime = self.ops.stat(path)
                except FileNotFoundError:
                    continue
                if mtime < older_than:
                    out.append(os.path.relpath(path, self.root).replace(os.sep, "/"))
        return sorted(out)

    def remove_incomplete(self, name: str) -> None:
        if TMP_MARK not in name.rsplit("/", 1)[-1]:
            raise InvalidInputError(f"{name!r} is not a temporary file")
        self._unlink_quiet(self._path(name))

    def _rel(self, path: object) -> str:
        if not isinstance(path, str):
            return "?"
        return os.path.relpath(path, self.root).replace(os.sep, "/")


def _mode(name: str, value: object) -> int:
    """A permission mode from an int or a string like ``"0o640"`` / ``"640"`` (octal)."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be a permission mode such as 0o600")
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        try:
            value = int(text, 8)
        except ValueError:
            raise InvalidInputError(f"{name} must be an octal permission mode such as 0o600") from None
    if not isinstance(value, int) or not 0 <= value <= 0o777:
        raise InvalidInputError(f"{name} must be a permission mode between 0o000 and 0o777")
    return value


LOCAL_OPTIONS = ("file_mode", "dir_mode")


def local_backend_options(storage_options: Mapping[str, Any] | None) -> dict[str, int]:
    """The storage options a local store accepts (``file_mode``, ``dir_mode``);
    an unknown key is refused, naming the key only (never its value)."""
    out: dict[str, int] = {}
    for k, v in (storage_options or {}).items():
        if k not in LOCAL_OPTIONS:
            raise InvalidInputError(
                f"storage option {k!r} is not valid for a local directory store (valid: {', '.join(LOCAL_OPTIONS)})"
            )
        out[k] = _mode(k, v)
    return out


def backend_from_url(url: str, storage_options: Mapping[str, Any] | None) -> LocalBackend:
    """``/path``, ``relative/path`` or ``file:///path``; the only storage
    options are ``file_mode`` and ``dir_mode``."""
    from urllib.parse import urlparse

    opts = local_backend_options(storage_options)
    modes = {"file_mode": opts.get("file_mode", DEFAULT_FILE_MODE), "dir_mode": opts.get("dir_mode", DEFAULT_DIR_MODE)}
    if "://" not in url:
        return LocalBackend(url, file_mode=modes["file_mode"], dir_mode=modes["dir_mode"])
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidInputError(f"{url}: file URLs must be local (file:///path)")
    return LocalBackend(parsed.path, file_mode=modes["file_mode"], dir_mode=modes["dir_mode"])
