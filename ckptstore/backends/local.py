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
* ``put_deferred`` / ``settle`` (pieces, PROTOCOL.md §9): ``put_deferred``
  writes the temp file and keeps it open, unsynced; ``settle`` fsyncs every
  pending file (concurrently: they share journal commits), renames each to
  its final name, then fsyncs each folder once. The order per object is ``put``'s (data durable before its name
  appears); only the fsyncs are batched. A crash before ``settle`` returned
  leaves temp files (removed like any other) or complete objects, never a
  torn object under a final name.
* ``create_lazy`` / ``delete_lazy`` (save intents, ledger entries; PROTOCOL.md
  §7.2): ``create`` without the directory fsync (the temp file is still
  fsynced before the link, so the record is never torn), ``delete`` without
  the directory fsync.
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

All system calls go through :class:`~ckptstore.backends.posix.PosixOps` so a test can substitute a
filesystem that simulates power loss.
"""

from __future__ import annotations

import builtins
import errno
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError, NotFoundError, StoreUnavailableError
from ..protocol.layout import RESERVED_MARK as TMP_MARK
from .base import MAX_KEY_DEPTH, Backend, Buffer, Capabilities, ObjectInfo, PendingPut, byte_limits, check_key
from .posix import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, NotAnObjectError, NotFollowedError, PosixOps

#: fsyncs issued at the same time by :meth:`LocalBackend.settle`
SETTLE_THREADS = 8

__all__ = ["LocalBackend", "NotAnObjectError", "NotFollowedError", "PosixOps", "backend_from_url"]


@dataclass
class _Pending:
    """A deferred put's temp file: its descriptor (-1 once closed), its path, its final path."""

    fd: int
    tmp: str
    final: str
    #: its bytes are fsynced already (``settle_data``)
    synced: bool = False


class LocalBackend(Backend):
    capabilities = Capabilities(atomic_create=True, consistent_list=True)
    #: a version-3 restore reads a component's pieces four at a time: a cold-cache restore of a 240 MiB
    #: state (47 files) took 275-352 ms one at a time, 170-250 ms four at a time; warm, no change
    #: (docs/performance.md, "Restore: the default path reads every byte once")
    objects_concurrency = 4

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        ops: PosixOps | None = None,
        create_root: bool = True,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
        anchor: str | os.PathLike[str] | None = None,
    ) -> None:
        """``anchor``: the directory (``root`` or one above it) below which
        nothing is followed; by default ``root`` itself. A local tier's rank
        folder ``<tier>/rank-3`` opened with ``anchor=<tier>`` is itself
        resolved without following links (a link planted at ``rank-3`` is
        refused, never written through); the anchor is the operator's."""
        self.root = os.path.abspath(os.fspath(root))
        self.url = Path(self.root).as_uri()
        self.ops = ops or PosixOps()
        top = self.root if anchor is None else os.path.abspath(os.fspath(anchor))
        if top != self.root and not self.root.startswith(top.rstrip(os.sep) + os.sep):
            raise InvalidInputError(f"{self.root}: the anchor {top} is not a directory above it")
        self.ops.attach(top, file_mode=_mode("file_mode", file_mode), dir_mode=_mode("dir_mode", dir_mode))
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
        fd, tmp = self._write_open(final, chunks)
        try:
            self.ops.fsync(fd)
        except BaseException:
            self.ops.close(fd)
            self._unlink_quiet(tmp)
            raise
        self.ops.close(fd)
        return tmp

    def _write_open(self, final: str, chunks: Iterable[Buffer]) -> tuple[int, str]:
        """Write a new temp file next to ``final``; (its open descriptor, its path), not synced."""
        d, name = os.path.split(final)
        self._makedirs(d)
        tmp = os.path.join(d, f".{name}{TMP_MARK}{uuid.uuid4().hex[:12]}")
        fd = self.ops.open_new(tmp)
        try:
            for c in chunks:
                self.ops.write(fd, c)
        except BaseException:
            self.ops.close(fd)
            self._unlink_quiet(tmp)
            raise
        return fd, tmp

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
        return StoreUnavailableError(f"{self.root}: I/O error on {key!r}: {exc}")

    # -- interface -------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, None)

    @contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """What a read meets below the root, as the interface's NotFoundError."""
        try:
            yield
        except (NotFollowedError, NotAnObjectError) as exc:
            raise NotFoundError(f"{self.url}/{key}: not an object: {exc.strerror} (never read)") from None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFoundError(f"{self.url}/{key}: no such object") from None

    def get_range(self, key: str, start: int, end: int | None) -> bytes:
        with self._reading(key):
            return self.ops.read(self._path(key), start, end)

    def readinto(self, key: str, start: int, out: memoryview) -> int:
        with self._reading(key):
            return self.ops.readinto(self._path(key), start, out)

    def put(self, key: str, chunks: Iterable[Buffer]) -> None:
        final = self._path(key)
        try:
            tmp = self._write_tmp(final, chunks)
            self.ops.rename(tmp, final)
            self.ops.fsync_dir(os.path.dirname(final))
        except OSError as exc:
            raise self._os_error(exc, key) from exc

    def put_deferred(self, key: str, chunks: Iterable[Buffer]) -> PendingPut:
        """Write the object's temp file, kept open and unsynced until :meth:`settle`."""
        final = self._path(key)
        try:
            fd, tmp = self._write_open(final, chunks)
        except OSError as exc:
            raise self._os_error(exc, key) from exc
        return PendingPut(key, _Pending(fd, tmp, final))

    def _fsync_pending(self, items: Sequence[PendingPut]) -> None:
        """fsync every open temp file of ``items`` not fsynced yet (concurrently: they share journal commits)."""
        todo = [h for p in items if isinstance(h := p.handle, _Pending) and h.fd >= 0 and not h.synced]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(SETTLE_THREADS, len(todo)), thread_name_prefix="ckptstore-fsync") as pool:
                list(pool.map(self.ops.fsync, [h.fd for h in todo]))
        elif todo:
            self.ops.fsync(todo[0].fd)
        for h in todo:
            h.synced = True

    def settle_data(self, pending: Sequence[PendingPut]) -> None:
        """fsync the pending temp files now (their renames and folder fsyncs wait
        for :meth:`settle`, which then skips these fsyncs): a caller that
        settles many objects at the end fsyncs each as soon as it is written,
        while the next one is being written."""
        try:
            self._fsync_pending(pending)
        except OSError as exc:
            raise self._os_error(exc, pending[0].key if pending else "") from exc

    def settle(self, pending: Sequence[PendingPut]) -> None:
        """fsync every pending temp file (those :meth:`settle_data` did not),
        rename each to its key, then fsync each folder once. On failure every
        temp file not yet renamed is closed and removed, and the error raised."""
        items = [p for p in pending if isinstance(p.handle, _Pending)]
        todo = list(items)
        try:
            self._fsync_pending(items)
            for p in items:
                h = p.handle
                assert isinstance(h, _Pending)
                if h.fd >= 0:
                    fd, h.fd = h.fd, -1
                    self.ops.close(fd)
            dirs: dict[str, None] = {}
            for p in items:
                h = p.handle
                assert isinstance(h, _Pending)
                self.ops.rename(h.tmp, h.final)
                todo.remove(p)
                dirs[os.path.dirname(h.final)] = None
            for d in dirs:
                self.ops.fsync_dir(d)
        except OSError as exc:
            raise self._os_error(exc, items[0].key if items else "") from exc
        finally:
            for p in todo:
                h = p.handle
                assert isinstance(h, _Pending)
                if h.fd >= 0:
                    fd, h.fd = h.fd, -1
                    try:
                        self.ops.close(fd)
                    except OSError:
                        pass
                self._unlink_quiet(h.tmp)

    def create(self, key: str, data: bytes) -> bool:
        return self._create(key, data, durable=True)

    def create_lazy(self, key: str, data: bytes) -> bool:
        """:meth:`create` without the directory fsync: the record's bytes are
        durable before its name appears (never torn), the name may not
        survive a power loss."""
        return self._create(key, data, durable=False)

    def _create(self, key: str, data: bytes, *, durable: bool) -> bool:
        final = self._path(key)
        try:
            tmp = self._write_tmp(final, [data])
            try:
                self.ops.link(tmp, final)
            except FileExistsError:
                return False
            finally:
                self._unlink_quiet(tmp)
            if durable:
                self.ops.fsync_dir(os.path.dirname(final))
            return True
        except OSError as exc:
            raise self._os_error(exc, key) from exc

    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        # prefix may end mid-name; walk the deepest existing directory (flat: read it alone).
        top = self._list_top(prefix)
        out: list[ObjectInfo] = []
        if top is None:
            return out
        for dirpath, files in self._walk_matching(top, prefix.rsplit("/", 1)[-1], flat):
            rel = self._rel_dir(dirpath)
            inside = rel.startswith(prefix)  # every key of the folder has the prefix: not checked one by one
            for f, size, mtime in files:
                key = rel + f
                if TMP_MARK not in f and (inside or key.startswith(prefix)):
                    out.append(ObjectInfo(key, size, mtime))
        out.sort(key=lambda o: o.key)
        return out

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> builtins.list[str]:
        """Names only: the directory entries' types tell files from the rest,
        nothing is stat'ed; folders whose keys all sort before ``start_after``
        are not entered (``flat``: none is)."""
        top = self._list_top(prefix)
        if top is None:
            return []
        keys: builtins.list[str] = []
        for dirpath, dirs, files in self.ops.walk(top, descend=not flat):
            rel = self._rel_dir(dirpath)
            if start_after:  # prune: every key in folder rel+d+'/' sorts before start_after
                dirs[:] = [d for d in dirs if (p := rel + d + "/") > start_after or start_after.startswith(p)]
            found = [rel + f for f in files if TMP_MARK not in f]
            if not rel.startswith(prefix):
                found = [k for k in found if k.startswith(prefix)]
            keys += [k for k in found if k > start_after] if start_after else found
        keys.sort()
        return keys if limit is None else keys[: max(0, limit)]

    def get_many(self, keys: Sequence[str], max_bytes: int | Sequence[int]) -> builtins.list[bytes | None]:
        """Each folder resolved once (no link followed), its files read relative to it."""
        limits = byte_limits(keys, max_bytes)
        groups: dict[str, builtins.list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(os.path.dirname(self._path(k)), []).append(i)
        out: builtins.list[bytes | None] = [None] * len(keys)
        for directory, idx in groups.items():
            names = [keys[i].rsplit("/", 1)[-1] for i in idx]
            try:
                got = self.ops.read_many(directory, names, [limits[i] for i in idx])
            except (NotFollowedError, NotAnObjectError):
                continue  # a link or a non-directory in the way: not objects
            except OSError as exc:
                raise StoreUnavailableError(f"{self.root}: I/O error reading {len(idx)} records: {exc}") from None
            for i, data in zip(idx, got, strict=True):
                out[i] = data
        return out

    def _walk_matching(
        self, top: str, rest: str, flat: bool
    ) -> Iterator[tuple[str, builtins.list[tuple[str, int, float]]]]:
        """``walk_stat`` of ``top``, entering only the subfolders whose names
        start with ``rest`` (the prefix's unfinished last name): listing
        ``pieces/<step>-`` walks that step's folders, not every save's."""
        if flat or not rest:
            yield from self.ops.walk_stat(top, descend=not flat)
            return
        yield from self.ops.walk_stat(top, descend=False)
        for dirpath, dirs, _files in self.ops.walk(top, descend=False):
            for d in dirs:
                if d.startswith(rest):
                    yield from self.ops.walk_stat(os.path.join(dirpath, d), max_depth=MAX_KEY_DEPTH - 1)

    def _list_top(self, prefix: str) -> str | None:
        """The deepest directory of ``prefix`` (which may end mid-name), if it is one."""
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._path(base_key) if base_key else self.root
        return top if self.ops.is_dir(top) else None

    def _rel_dir(self, dirpath: str) -> str:
        """The key prefix of the files in ``dirpath`` ('' at the root, else 'a/b/')."""
        if dirpath == self.root:
            return ""
        if dirpath.startswith(self.root.rstrip(os.sep) + os.sep):
            rel = dirpath[len(self.root.rstrip(os.sep)) + 1 :]
        else:
            rel = os.path.relpath(dirpath, self.root)
        return rel.replace(os.sep, "/") + "/"

    def size(self, key: str) -> int:
        try:
            return self.ops.stat(self._path(key))[0]
        except (NotFollowedError, NotAnObjectError) as exc:
            raise NotFoundError(f"{self.url}/{key}: not an object: {exc.strerror}") from None
        except (FileNotFoundError, NotADirectoryError):
            raise NotFoundError(f"{self.url}/{key}: no such object") from None

    def delete(self, key: str) -> None:
        self._delete(key, durable=True)

    def delete_lazy(self, key: str) -> None:
        """:meth:`delete` without the directory fsync (a power loss may bring the object back)."""
        self._delete(key, durable=False)

    def _delete(self, key: str, *, durable: bool) -> None:
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
        if durable:
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
        # a temporary file lies next to the key it becomes, never deeper than any key: a
        # folder chain below that is not searched (prune_deep), never an error for gc
        for dirpath, _dirs, files in self.ops.walk(top, prune_deep=True):
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
