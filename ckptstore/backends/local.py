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

All system calls go through :class:`PosixOps` so a test can substitute a
filesystem that simulates power loss.
"""

from __future__ import annotations

import builtins
import errno
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from ..errors import InvalidInputError, NotFoundError, StoreUnavailableError
from ..protocol.layout import RESERVED_MARK as TMP_MARK
from .base import Backend, Buffer, Capabilities, ObjectInfo, check_key


class PosixOps:
    """The system calls the local backend uses; replaceable for fault injection."""

    def open_new(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)

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
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        with open(path, "rb") as f:
            if start:
                f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def stat(self, path: str) -> tuple[int, float]:
        st = os.stat(path)
        return st.st_size, st.st_mtime

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def walk(self, top: str) -> Iterable[tuple[str, list[str], list[str]]]:
        return os.walk(top)


class LocalBackend(Backend):
    capabilities = Capabilities(atomic_create=True, consistent_list=True)

    def __init__(self, root: str | os.PathLike[str], *, ops: PosixOps | None = None, create_root: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = Path(self.root).as_uri()
        self.ops = ops or PosixOps()
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
                    raise InvalidInputError(f"{d}: exists and is not a directory") from None
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
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreUnavailableError(f"{self.root}: no space left while writing {key!r}")
        if isinstance(exc, PermissionError):
            return StoreUnavailableError(f"{self.root}: permission denied writing {key!r}")
        return StoreUnavailableError(f"{self.root}: I/O error on {key!r}: {exc}")

    # -- interface -------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, None)

    def get_range(self, key: str, start: int, end: int | None) -> bytes:
        try:
            return self.ops.read(self._path(key), start, end)
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
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key, size, mtime))
        out.sort(key=lambda o: o.key)
        return out

    def size(self, key: str) -> int:
        try:
            return self.ops.stat(self._path(key))[0]
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.url}/{key}: no such object") from None

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            self.ops.unlink(path)
        except FileNotFoundError:
            return
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


def backend_from_url(url: str, storage_options: dict[str, object]) -> LocalBackend:
    """``/path``, ``relative/path`` or ``file:///path`` (no storage options)."""
    from urllib.parse import urlparse

    if storage_options:
        raise InvalidInputError(f"the local backend takes no storage options (got: {', '.join(sorted(storage_options))})")
    if "://" not in url:
        return LocalBackend(url)
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidInputError(f"{url}: file URLs must be local (file:///path)")
    return LocalBackend(parsed.path)
