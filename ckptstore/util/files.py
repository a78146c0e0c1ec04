"""Durable file writes on a local disk, the one home of the two steps every
writer of a local file needs: fsync of a directory (so a new or renamed entry
survives a power loss) and an atomic replace (readers see the old file or the
new one, never a part).

These follow links as the operating system does; the local backend's
no-follow primitives (:mod:`ckptstore.backends.posix`, relative to directory
descriptors), the Hugging Face tree writer (:mod:`ckptstore.integrations.hf_files`)
and the Lightning pointer writer (:mod:`ckptstore.integrations.lightning.files`)
keep their own, since they must not resolve a path by name at all.
"""

from __future__ import annotations

import os
import tempfile

_DIRFLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` durable (``fsync`` of the directory)."""
    fd = os.open(path, _DIRFLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """``os.replace(src, dst)`` (atomic: ``dst`` names the old entry or the new
    one), then fsync of ``dst``'s directory so the rename survives a power loss."""
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def write_atomic(path: str | os.PathLike[str], data: bytes, *, prefix: str = ".ckptstore-tmp-") -> None:
    """Replace the file at ``path`` with ``data`` atomically and durably: a
    temporary file in the same directory (named ``prefix...``) is written and
    fsynced, renamed over ``path``, and the directory fsynced. On any failure
    the temporary file is removed and ``path`` is untouched. The directory
    must exist."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(d)
