"""A local artifact directory, written and read through directory descriptors
(protocol_spec/THREATS.md §4.9.2).

Whoever can write the directory that holds ``--to`` can rename entries there
while a promotion runs: swap the hidden temporary directory for a link to a
directory of theirs, or put their own directory in its place. So no path
below that parent is resolved by name twice:

* :class:`NewArtifactDir` opens the parent once (the operator's
  configuration, resolved as given), creates the hidden temporary
  ``.NAME.partial-<hex>`` in it with mode ``0700`` (``mkdir`` relative to the
  parent's descriptor: anything already there, a link too, is ``EEXIST``),
  opens it ``O_DIRECTORY | O_NOFOLLOW`` and checks by ``fstat`` that it is the
  empty directory of this process's user it just made; its ``st_dev`` /
  ``st_ino`` are kept. Every file is created relative to that descriptor
  (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode ``0600``), written and fsynced, so
  a rename or a link at the temporary name cannot send a byte elsewhere.
* :meth:`NewArtifactDir.publish` fsyncs the directory, checks that the
  temporary name still names the directory created (same ``st_dev`` /
  ``st_ino``, ``lstat`` relative to the parent), renames it to ``NAME``
  (``renameat2(RENAME_NOREPLACE)`` where the kernel has it: an entry that
  appeared at ``NAME`` is never replaced), fsyncs the parent, checks that
  ``NAME`` now names the directory created, and only then gives it the
  published modes (:data:`PUBLISHED_DIR_MODE`, :data:`PUBLISHED_FILE_MODE`,
  less the process umask) through descriptors. Until then nothing of the
  artifact is readable by another user, wherever a rename moved it.
* :meth:`NewArtifactDir.abort` removes only the files it created (each
  checked by inode, relative to the held descriptor) and the temporary name
  when it still names the directory created; a planted link or a foreign
  directory is never removed.
* :class:`ArtifactDir` reads an artifact: the directory opened
  ``O_DIRECTORY | O_NOFOLLOW`` (a link at the artifact's own name is refused:
  pass the path it names), a bounded listing, each file opened relative to it
  with ``O_NOFOLLOW | O_NONBLOCK`` and checked ``S_ISREG`` by ``fstat`` before
  a byte is read (a FIFO never hangs the check), reads bounded by the caller.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import blake3

from ..errors import CorruptionError, InvalidInputError, NotFoundError, StoreUnavailableError

#: the artifact directory's mode once published (less the umask): served, so readable by others
PUBLISHED_DIR_MODE = 0o755
#: each file's mode once published (less the umask)
PUBLISHED_FILE_MODE = 0o644
#: modes while the artifact is being written: nobody else reads a byte of it before it is published
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
#: the most entries an artifact directory's listing may hold (a 5 GB shard each: petabytes)
MAX_ENTRIES = 100_000
BLOCK = 8 << 20

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRFLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
_READFLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_CREATEFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1

Stage = Callable[[str], None]

__all__ = ["MAX_ENTRIES", "PUBLISHED_DIR_MODE", "PUBLISHED_FILE_MODE", "ArtifactDir", "NewArtifactDir",
           "kind_of", "process_umask"]


def kind_of(mode: int) -> str:
    """What a file-system entry is, in words (for messages)."""
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


def process_umask() -> int:
    """The process umask, read without changing it where ``/proc`` says it
    (Linux); elsewhere by setting and restoring it."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old & 0o777


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@functools.cache
def _renameat2() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None


def _rename_noreplace(pfd: int, src: str, dst: str) -> bool:
    """``renameat2(pfd/src, pfd/dst, RENAME_NOREPLACE)``; False when the system
    has no such call (the caller then renames after its own check)."""
    fn = _renameat2()
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(pfd, os.fsencode(src), pfd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # no renameat2, or a file system without RENAME_NOREPLACE
        return False
    raise OSError(err, os.strerror(err), dst)


class NewArtifactDir:
    """A new local artifact at ``path`` (which must not exist), written into a
    private hidden sibling held by descriptor, then published by one rename
    (module docstring). ``on_stage`` is a fault point for tests: it is called
    with ``"created"`` once the temporary directory is made and checked,
    ``"checked"`` right before the rename (after the temporary was found to be
    the directory created) and ``"renamed"`` right after it (before the final
    name is checked)."""

    def __init__(self, path: str, *, on_stage: Stage | None = None) -> None:
        self.path = os.path.abspath(path)
        self.parent, self.name = os.path.split(self.path)
        self._stage = on_stage or (lambda _s: None)
        if not self.name or self.name in (".", ".."):
            raise InvalidInputError(f"{path!r}: not a directory name an artifact can be published at")
        try:
            self._pfd = os.open(self.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        except FileNotFoundError:
            raise InvalidInputError(f"{self.parent}: the artifact's parent directory does not exist") from None
        except NotADirectoryError:
            raise InvalidInputError(f"{self.parent}: the artifact's parent is not a directory") from None
        except OSError as exc:
            raise InvalidInputError(f"{self.parent}: cannot open the artifact's parent ({exc.strerror})") from None
        self._fd = -1
        self.id: tuple[int, int] = (-1, -1)
        self._files: dict[str, tuple[int, int]] = {}
        self.published = False
        self.tmp_name = f".{self.name}.partial-{uuid.uuid4().hex[:12]}"
        self.tmp = os.path.join(self.parent, self.tmp_name)
        try:
            if self._lstat(self.name) is not None:
                raise InvalidInputError(f"{self.path} already exists: an artifact is never overwritten; "
                                        "choose a new --to or remove it")
            try:
                os.mkdir(self.tmp_name, PRIVATE_DIR_MODE, dir_fd=self._pfd)
            except OSError as exc:
                raise self._unavailable("cannot create the temporary directory", exc) from None
            self._fd = self._open_created()
        except BaseException:
            self.close()
            raise
        self._stage("created")

    # -- helpers -----------------------------------------------------------
    def _lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self._pfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _unavailable(self, what: str, exc: OSError) -> StoreUnavailableError:
        return StoreUnavailableError(f"{self.parent}: {what} ({exc.strerror}); nothing was published at "
                                     f"{self.path}: free space or fix the permissions, then promote again")

    def _replaced(self, what: str) -> InvalidInputError:
        return InvalidInputError(
            f"{self.path}: {what}. Another user can rename entries in {self.parent}; nothing was published and "
            "no byte of the artifact was written outside the directory this promotion created (it stays private, "
            f"mode 0700). Promote into a directory only you can write (or one with the sticky bit), then again")

    def _open_created(self) -> int:
        try:
            fd = os.open(self.tmp_name, _DIRFLAGS, dir_fd=self._pfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise self._replaced(f"the temporary directory {self.tmp_name} was replaced right after it was "
                                     "created") from None
            raise self._unavailable("cannot open the temporary directory", exc) from None
        st = os.fstat(fd)
        try:
            empty = not os.listdir(fd)
        except OSError:
            empty = False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or not empty:
            os.close(fd)
            raise self._replaced(f"the temporary directory {self.tmp_name} is not the private, empty directory "
                                 "this promotion created")
        self.id = _ident(st)
        return fd

    # -- writing -----------------------------------------------------------
    def write(self, name: str, chunks: Iterable[Any]) -> tuple[int, str]:
        """Create ``name`` in the held directory (exclusively, mode 0600), write
        the chunks, fsync; (size, BLAKE3 hex)."""
        if not name or "/" in name or name in (".", "..") or name in self._files:
            raise InvalidInputError(f"{name[:80]!r}: not a new file name of an artifact")
        try:
            fd = os.open(name, _CREATEFLAGS, PRIVATE_FILE_MODE, dir_fd=self._fd)
        except OSError as exc:
            raise self._unavailable(f"cannot create {name}", exc) from None
        h, size = blake3.blake3(), 0
        try:
            self._files[name] = _ident(os.fstat(fd))
            for c in chunks:
                view = memoryview(c).cast("B")
                h.update(view)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                    size += n
            os.fsync(fd)
        except OSError as exc:
            raise self._unavailable(f"cannot write {name}", exc) from None
        finally:
            os.close(fd)
        return size, h.hexdigest()

    def publish(self) -> tuple[int, int]:
        """Rename the complete directory to its final name, check that what is
        published is the directory created, then give it the published modes.
        Returns its (st_dev, st_ino)."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise self._unavailable("cannot fsync the temporary directory", exc) from None
        st = self._lstat(self.tmp_name)
        if st is None or not stat.S_ISDIR(st.st_mode) or _ident(st) != self.id:
            what = "gone" if st is None else f"a {kind_of(st.st_mode)} that is not the directory it created"
            raise self._replaced(f"the temporary directory {self.tmp_name} was replaced while the artifact was "
                                 f"written (it is now {what})")
        self._stage("checked")
        try:
            if not _rename_noreplace(self._pfd, self.tmp_name, self.name):
                if self._lstat(self.name) is not None:
                    raise InvalidInputError(f"{self.path} appeared while the artifact was written; nothing was "
                                            "published: remove it or choose a new --to, then promote again")
                os.rename(self.tmp_name, self.name, src_dir_fd=self._pfd, dst_dir_fd=self._pfd)
        except FileExistsError:
            raise InvalidInputError(f"{self.path} appeared while the artifact was written; nothing was "
                                    "published: remove it or choose a new --to, then promote again") from None
        except OSError as exc:
            raise self._unavailable("cannot rename the artifact into place", exc) from None
        self._stage("renamed")
        try:
            os.fsync(self._pfd)
        except OSError as exc:
            raise self._unavailable("cannot fsync the artifact's parent", exc) from None
        st = self._lstat(self.name)
        if st is None or not stat.S_ISDIR(st.st_mode) or _ident(st) != self.id:
            raise self._replaced(f"what the rename published at {self.name} is not the directory this promotion "
                                 "created (the temporary name was swapped at the moment of the rename); it was "
                                 "left as it is: remove it")
        self.published = True
        self._make_public()
        return self.id

    def _make_public(self) -> None:
        mask = process_umask()
        try:
            for name, ident in self._files.items():
                fd = os.open(name, _READFLAGS, dir_fd=self._fd)
                try:
                    if _ident(os.fstat(fd)) != ident:
                        raise self._replaced(f"{name} inside the artifact is not the file this promotion wrote")
                    os.fchmod(fd, PUBLISHED_FILE_MODE & ~mask)
                finally:
                    os.close(fd)
            os.fchmod(self._fd, PUBLISHED_DIR_MODE & ~mask)
            os.fsync(self._fd)
        except OSError as exc:
            raise self._unavailable("cannot set the published modes", exc) from None

    def abort(self) -> None:
        """Remove what this promotion wrote and nothing else (module docstring)."""
        if self._fd < 0 or self.published:
            return
        for name, ident in self._files.items():
            try:
                if _ident(os.stat(name, dir_fd=self._fd, follow_symlinks=False)) == ident:
                    os.unlink(name, dir_fd=self._fd)
            except OSError:
                pass
        st = self._lstat(self.tmp_name)
        if st is not None and stat.S_ISDIR(st.st_mode) and _ident(st) == self.id:
            try:
                os.rmdir(self.tmp_name, dir_fd=self._pfd)  # only if empty: never anything planted in it
            except OSError:
                pass

    def close(self) -> None:
        for fd in (self._fd, self._pfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._pfd = -1


class ArtifactDir:
    """An artifact directory opened for reading (module docstring). Use as a
    context manager. :attr:`id` is its (st_dev, st_ino)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, _DIRFLAGS)
        except FileNotFoundError:
            raise NotFoundError(f"{path}: no such artifact") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                try:
                    kind = kind_of(os.lstat(path).st_mode)
                except OSError:
                    kind = "not a directory"
                raise CorruptionError(f"{path}: a {kind}, not an artifact directory; an artifact is never a link "
                                      "(pass the directory it names, after checking whose it is)") from None
            raise CorruptionError(f"{path}: cannot open the artifact directory ({exc.strerror})") from None
        self.id = _ident(os.fstat(self._fd))

    def __enter__(self) -> ArtifactDir:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def names(self) -> list[str]:
        """Every entry's name (at most :data:`MAX_ENTRIES`; more is an error, never a cut listing)."""
        out: list[str] = []
        with os.scandir(self._fd) as it:
            for e in it:
                out.append(e.name)
                if len(out) > MAX_ENTRIES:
                    raise CorruptionError(f"{self.path}: more than {MAX_ENTRIES} entries; not an artifact")
        return sorted(out)

    def _open(self, name: str) -> int:
        if not name or "/" in name or name in (".", ".."):
            raise CorruptionError(f"{name[:80]!r}: not a file name of an artifact")
        try:
            fd = os.open(name, _READFLAGS, dir_fd=self._fd)
        except FileNotFoundError:
            raise NotFoundError(f"{self.path}/{name}: no such file") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptionError(f"{name}: a symbolic link, not a regular file (never followed)") from None
            raise CorruptionError(f"{name}: cannot be opened ({exc.strerror})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CorruptionError(f"{name}: a {kind_of(st.st_mode)}, not a regular file (never read)")
        return fd

    def blocks(self, name: str, max_bytes: int) -> Iterator[bytes]:
        """The file's bytes, at most ``max_bytes + 1`` of them (the caller
        judges a file that is longer than it should be)."""
        fd = self._open(name)
        try:
            got = 0
            while got <= max_bytes:
                block = os.pread(fd, min(BLOCK, max_bytes + 1 - got), got)
                if not block:
                    break
                got += len(block)
                yield block
        finally:
            os.close(fd)

    def read(self, name: str, max_bytes: int) -> bytes:
        """The whole file; longer than ``max_bytes`` is :class:`CorruptionError`."""
        data = b"".join(self.blocks(name, max_bytes))
        if len(data) > max_bytes:
            raise CorruptionError(f"{name}: larger than the {max_bytes} bytes allowed")
        return data
