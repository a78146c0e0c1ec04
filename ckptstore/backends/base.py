"""The storage interface every backend implements.

Backends are deliberately dumb: they move bytes and report what happened.
Retries, conflict resolution (the lost-acknowledgement read-back), hashing and
selection live above them (:mod:`ckptstore.core.bounded_io` and up), written once.

Contract (each backend's conformance tests check it):

* ``put(key, chunks)`` writes an object (replacing any existing one) and
  returns only when it is durable as far as the backend can promise (fsync of
  the file and its directory on POSIX; a completed PUT on object stores).
* ``create(key, data)`` is an **atomic create-if-absent**: it returns True when
  this call created the object, False when an object already existed at the
  key (and leaves it untouched). Two racing callers: exactly one gets True.
  A backend that cannot do this sets ``capabilities.atomic_create = False``
  and raises :class:`UnsupportedBackendError` from ``create``; the store then
  refuses to commit instead of falling back to check-then-write.
* ``get`` / ``get_range`` / ``size`` raise :class:`NotFoundError` for a missing
  key. ``get_range`` never returns more than ``end - start`` bytes (the store
  bounds every read with it). ``list(prefix)`` returns every object under the prefix (recursive),
  never directories or temp files; an empty "directory" is no object.
* ``list_keys(prefix, start_after=, limit=)`` is ``list`` without sizes and
  in pages: exactly ``[o.key for o in list(prefix) if o.key > start_after][:limit]``,
  in ascending code-point (= UTF-8 byte) order. Object stores serve it with
  one request per page of up to 1,000 keys, starting at ``start_after``, so
  a caller that needs the first keys of a long prefix pays for those only;
  the local disk reads names only (no stat per entry). (An S3 server that
  lists folder by folder, as SeaweedFS does, departs from byte order only
  where a name continues with a character below '/' while a sibling descends
  into a folder; ckptstore's own names never do.)
* ``flat=True`` (``list`` and ``list_keys``): only the keys directly under
  ``prefix`` (no '/' after it); nothing below is walked or asked for (a
  delimiter listing on object stores, one directory read on a disk). The
  prefixes whose names are flat (``commits/``, ``attempts/``, ``events/``)
  are listed so: a planted folder chain there is not walked at all.
* A recursive listing never goes deeper than :data:`MAX_KEY_DEPTH` folders
  below the listed prefix: a deeper key raises
  :class:`~ckptstore.errors.LimitReachedError` (never a crash, never a
  shorter listing taken for the whole). Walks are iterative.
* ``get_many(keys, max_bytes)`` is ``get_range(key, 0, max_bytes)`` of each
  key, None where there is no such object, in one call (concurrent requests,
  one folder resolution): how ``list_saves`` and gc read many records.
  ``max_bytes`` is one bound for all keys or one per key (a batch of records
  is read each at its listed size + 1, so records that grew cannot cost the
  record cap each).
* ``put_deferred(key, chunks)`` + ``settle(pending)``: a put whose
  durability may wait. ``put_deferred`` writes the object's bytes and returns
  a :class:`PendingPut`; the object is at its key and durable only once
  ``settle`` (given it, with others) returned. Until then the key may not
  exist, or, after a crash, never come to exist. A caller must settle every
  pending put before anything that names the object (a commit record) is
  written. The default is ``put`` (durable at once) and a ``settle`` that
  does nothing; the local disk overrides both, so many objects share one
  pass of fsyncs and one directory fsync per folder. ``settle_data(pending)``
  (optional, default nothing) starts that work early: the bytes are made
  durable, the keys still wait for ``settle``.
* ``create_lazy(key, data)`` / ``delete_lazy(key)``: ``create`` / ``delete``
  whose durability may lag the return. On return the effect is visible to
  every later read and listing, as ``create``'s and ``delete``'s are, and a
  lazily created object is never torn (its bytes are durable before its
  name appears); only the name's durability is not waited for, so a crash of
  the storage's host may undo either. For records whose loss in such a crash
  protects or breaks nothing (save intents, ledger entries:
  PROTOCOL.md §7.2). The defaults are ``create`` and ``delete`` (durable);
  the local disk skips the directory fsync.
* ``delete`` of a missing key is not an error.
* Infrastructure failures raise :class:`StoreUnavailableError`, or
  :class:`TransientError` when a retry may help.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Buffer = bytes | bytearray | memoryview

#: Folders a recursive listing descends below its prefix. No key of the
#: protocol is this deep (a component name is at most 512 characters, so at
#: most 256 segments, under ``<run>/saves/<save>/``); a deeper chain is not
#: ckptstore's and stops the listing with an error.
MAX_KEY_DEPTH = 300


@dataclass(frozen=True)
class Capabilities:
    """What the layers above may rely on. Without ``atomic_create`` the store
    refuses to write; without ``consistent_list`` the read-after-write
    inventory check asks for each object's size instead of trusting one
    listing; ``list_pages`` only tunes how keys are asked for."""

    atomic_create: bool = True
    #: Listing after a write sees the write (S3, GCS, POSIX, memory all do).
    consistent_list: bool = True
    #: ``list_keys`` costs one request per page (object stores): callers that
    #: need only the first keys ask for small pages. False: every call reads
    #: the whole prefix anyway (a directory on disk), so ask for all at once.
    list_pages: bool = False
    #: A listed :attr:`ObjectInfo.version` of an object written in one request is the MD5 of its
    #: bytes (an S3 ETag): bytes held elsewhere can be proven to be the listed object's (the record
    #: pack, PROTOCOL.md §4.7.1). Only tunes cost: False (the default) reads every record itself.
    version_is_md5: bool = False


def check_key(key: str) -> str:
    """Refuse keys that could leave a backend's root (every backend calls this)."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\x00" in key or ".." in key.split("/"):
        from ..errors import InvalidInputError

        raise InvalidInputError(f"invalid key {str(key)[:120]!r}")
    return key


def byte_limits(keys: Sequence[str], max_bytes: int | Sequence[int]) -> builtins.list[int]:
    """The bound of each key of a ``get_many`` call (one for all, or one per key)."""
    if isinstance(max_bytes, int):
        return [max_bytes] * len(keys)
    limits = [int(m) for m in max_bytes]
    if len(limits) != len(keys):
        from ..errors import InvalidInputError

        raise InvalidInputError(f"get_many: {len(limits)} bounds for {len(keys)} keys")
    return limits


def too_deep(url: str, where: str) -> Exception:
    """The error for a folder chain deeper than :data:`MAX_KEY_DEPTH` at ``where``."""
    from ..errors import LimitReachedError

    return LimitReachedError(
        f"{url}: a chain of folders deeper than {MAX_KEY_DEPTH} levels under {where[:200]!r}: no ckptstore key "
        "is that deep, so it is not ckptstore's; the listing stopped there (nothing was selected or deleted "
        "from it). Remove the chain by hand."
    )


def check_depth(url: str, prefix: str, keys: Iterable[str]) -> None:
    """Raise :func:`too_deep` if a key lies more than :data:`MAX_KEY_DEPTH` folders below ``prefix``."""
    cut = prefix.rfind("/") + 1
    for k in keys:
        if k.count("/", cut) > MAX_KEY_DEPTH:
            raise too_deep(url, k[: cut + 200])


def only_flat(prefix: str, keys: Iterable[str]) -> builtins.list[str]:
    """The keys directly under ``prefix`` (no '/' after it)."""
    n = len(prefix)
    return [k for k in keys if "/" not in k[n:]]


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    #: Last modification, seconds since the epoch (the server's clock on object stores).
    mtime: float
    #: The stored content's version as the backend reports it, "" where it reports none: the
    #: ETag on S3, the generation on GCS, a per-write counter in memory. Compared for equality
    #: only, never parsed. A same-size rewrite within the server's clock resolution (SeaweedFS
    #: lists whole seconds) keeps ``mtime`` but not ``version`` (PROTOCOL.md §9.2 "Evidence").
    version: str = ""


@dataclass
class PendingPut:
    """A put written by :meth:`Backend.put_deferred`, durable only once settled.
    ``handle``: backend-specific state (the default backend's is None: durable already)."""

    key: str
    handle: object = None


class Backend(abc.ABC):
    """Abstract storage backend. Keys are '/'-separated relative paths."""

    capabilities: Capabilities = Capabilities()
    #: Human-readable location, used in messages.
    url: str = ""
    #: ranges of one object worth reading at the same time (object stores: latency hides behind concurrency)
    read_concurrency: int = 1
    #: small objects (a component's pieces, version 3) worth reading at the same time; None: as
    #: ``read_concurrency``. A local disk sets its own: one file's spans gain nothing from concurrent reads
    #: there, while several cold files do (each open and first read waits on the disk)
    objects_concurrency: int | None = None

    @abc.abstractmethod
    def get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (shorter if the object is shorter)."""

    def readinto(self, key: str, start: int, out: memoryview) -> int:
        """Fill ``out`` with the object's bytes from ``start``; the count
        written (short when the object ends first). Backends that can read
        straight into the caller's memory override this; the default copies
        from :meth:`get_range`."""
        data = self.get_range(key, start, start + len(out))
        n = min(len(data), len(out))
        out[:n] = memoryview(data)[:n]
        return n

    @abc.abstractmethod
    def put(self, key: str, chunks: Iterable[Buffer]) -> None: ...

    def put_deferred(self, key: str, chunks: Iterable[Buffer]) -> PendingPut:
        """Write an object whose durability waits for :meth:`settle` (see the
        module docstring). This default is :meth:`put`: durable on return."""
        self.put(key, chunks)
        return PendingPut(key)

    def settle_data(self, pending: Sequence[PendingPut]) -> None:  # noqa: B027 - optional hook
        """Start :meth:`settle`'s work early: make the bytes of ``pending``
        durable now; their keys still appear only with :meth:`settle`, which
        every pending put still needs. The local disk fsyncs the files (so one
        object's fsync overlaps the writing of the next); this default does nothing."""

    def settle(self, pending: Sequence[PendingPut]) -> None:  # noqa: B027 - optional hook
        """Make every put of ``pending`` (from :meth:`put_deferred` of this
        backend) durable at its key; on return all are, or it raised and any
        of them may be missing. This default does nothing (they were durable)."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> bool: ...

    def create_lazy(self, key: str, data: bytes) -> bool:
        """:meth:`create` whose name may not survive a crash of the storage's
        host (see the module docstring); never torn. This default is :meth:`create`."""
        return self.create(key, data)

    @abc.abstractmethod
    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]: ...

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> builtins.list[str]:
        """Keys under ``prefix`` greater than ``start_after``, ascending, at
        most ``limit`` (see the module docstring). This default derives them
        from :meth:`list`; backends that can page or skip the stat override it."""
        keys = [o.key for o in self.list(prefix, flat=flat) if o.key > start_after]
        return keys if limit is None else keys[: max(0, limit)]

    def get_many(self, keys: Sequence[str], max_bytes: int | Sequence[int]) -> builtins.list[bytes | None]:
        """The first ``max_bytes`` bytes of each of many small objects (None
        where there is no such object), in the order of ``keys``; ``max_bytes``
        is one bound or one per key (:func:`byte_limits`). Object stores
        send the reads concurrently, the local disk resolves each folder once;
        this default reads them one by one. Any other failure raises."""
        from ..errors import NotFoundError

        out: builtins.list[bytes | None] = []
        for k, limit in zip(keys, byte_limits(keys, max_bytes), strict=True):
            try:
                out.append(self.get_range(k, 0, limit))
            except NotFoundError:
                out.append(None)
        return out

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def delete_lazy(self, key: str) -> None:
        """:meth:`delete` that a crash of the storage's host may undo (see the
        module docstring). This default is :meth:`delete`."""
        self.delete(key)

    def exists(self, key: str) -> bool:
        from ..errors import NotFoundError

        try:
            self.size(key)
        except NotFoundError:
            return False
        return True

    def list_incomplete(self, prefix: str, older_than: float) -> builtins.list[str]:
        """What killed writers left behind under ``prefix``, last touched before
        ``older_than`` (epoch seconds), that is not an object: temporary files
        on a disk, unfinished multipart uploads on S3. Handles are opaque
        strings for :meth:`remove_incomplete`. Backends that leave nothing
        behind return []."""
        return []

    def remove_incomplete(self, handle: str) -> None:  # noqa: B027 - optional hook
        """Remove one entry returned by :meth:`list_incomplete`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients and connections. Idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
