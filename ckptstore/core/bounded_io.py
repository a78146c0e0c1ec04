"""The run I/O floor: one backend, one retry policy, one run's keys.

Everything above (fencing, catalog, writer, reader, gc) reaches storage only
through :class:`RunIO`, which adds what every caller needs and no backend
should repeat: retries with backoff, bounded reads of records, the
create-if-absent with the lost-acknowledgement read-back, streamed puts hashed
while written, and bounded, verified streaming of components.
"""

from __future__ import annotations

import builtins
import mmap
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from functools import partial
from typing import Any, TypeVar

import blake3

from ..backends.base import Backend, ObjectInfo, PendingPut
from ..errors import CommitUnknownError, CorruptionError, NotFoundError, StoreUnavailableError, TransientError
from ..protocol import ComponentEntry, Layout
from ..retry import RetryPolicy
from ..util.redact import redact_text
from . import hashing
from .hashing import CHUNK, BackgroundHasher, HashingStream, Scatter, as_scatter, is_replayable, rewind

T = TypeVar("T")


class RunIO:
    """Storage access for one run of one store."""

    def __init__(self, backend: Backend, run_id: str, retry: RetryPolicy | None = None) -> None:
        self.backend = backend
        self.run_id = run_id
        self.retry = retry or RetryPolicy()
        #: component bytes read so far (reads of records not counted)
        self.bytes_read = 0
        #: how the run names its commits (PROTOCOL.md §1.1): set by :mod:`.binding`
        #: once the run record was read or created
        self.layout_or_none: Layout | None = None

    @property
    def layout(self) -> Layout:
        if self.layout_or_none is None:
            raise AssertionError(f"run {self.run_id!r}: its layout is not known before its run record was read")
        return self.layout_or_none

    def where(self, key: str) -> str:
        """A human-readable location for messages."""
        return f"{self.backend.url.rstrip('/')}/{key}"

    # ------------------------------------------------------------ plain ops
    def list(self, prefix: str, *, flat: bool = False) -> list[ObjectInfo]:
        if not flat:
            return self.retry.call(lambda: self.backend.list(prefix))
        return self.retry.call(lambda: self.backend.list(prefix, flat=True))

    def list_keys(
        self, prefix: str, *, start_after: str = "", limit: int | None = None, flat: bool = False
    ) -> builtins.list[str]:
        """Keys under ``prefix`` after ``start_after``, ascending, names only (``Backend.list_keys``;
        ``flat``: only those directly under it)."""
        if not flat:
            return self.retry.call(lambda: self.backend.list_keys(prefix, start_after=start_after, limit=limit))
        return self.retry.call(lambda: self.backend.list_keys(prefix, start_after=start_after, limit=limit, flat=True))

    def size(self, key: str) -> int:
        return self.retry.call(lambda: self.backend.size(key))

    def delete(self, key: str, *, lazy: bool = False) -> None:
        """Delete ``key``; ``lazy``: a crash of the storage's host may undo it
        (``Backend.delete_lazy``: for records whose return after such a crash protects or breaks nothing)."""
        if lazy:
            self.retry.call(lambda: self.backend.delete_lazy(key))
        else:
            self.retry.call(lambda: self.backend.delete(key))

    def get_bounded(self, key: str, max_bytes: int) -> bytes:
        """The object's bytes, reading at most ``max_bytes + 1`` of them (a
        longer object comes back one byte too long, for the caller's size
        check to refuse)."""
        return self.retry.call(lambda: self.backend.get_range(key, 0, max_bytes + 1))

    def get_many_bounded(
        self, keys: builtins.list[str], max_bytes: int, listed: builtins.list[int] | None = None
    ) -> builtins.list[bytes | None]:
        """:meth:`get_bounded` of many small objects at once (None: no such
        object); if the batch fails transiently, one by one with retries.
        ``listed``: each key's size in the listing that named it; each is then
        read up to that size + 1 (still at most ``max_bytes + 1``), so a batch
        of records that grew since the listing costs their listed sizes, not
        the cap each (a longer object comes back one byte longer than listed)."""
        limits = [max_bytes] * len(keys) if listed is None else [min(max_bytes, max(0, n)) for n in listed]
        if len(limits) != len(keys):
            raise ValueError(f"get_many_bounded: {len(limits)} sizes for {len(keys)} keys")
        try:
            return self.backend.get_many(keys, [m + 1 for m in limits])
        except TransientError:
            pass
        out: builtins.list[bytes | None] = []
        for k, m in zip(keys, limits, strict=True):
            try:
                out.append(self.get_bounded(k, m))
            except NotFoundError:
                out.append(None)
        return out

    # --------------------------------------------------------------- create
    def create(self, key: str, data: bytes, *, what: str, lazy: bool = False) -> bool:
        """Create-if-absent with retries and the lost-acknowledgement read-back.
        ``lazy``: ``Backend.create_lazy`` (visible on return, never torn, its
        name not waited on to be durable: save intents and ledger entries,
        PROTOCOL.md §7.2).

        Returns True if *our* bytes are now at ``key`` (created by this call or
        by an earlier try whose reply was lost), False if someone else's are.
        Raises :class:`CommitUnknownError` when the outcome cannot be settled.
        """
        uncertain = False
        policy = self.retry
        for i in range(policy.attempts):
            try:
                created = self.backend.create_lazy(key, data) if lazy else self.backend.create(key, data)
            except TransientError as exc:
                uncertain = True
                if i == policy.attempts - 1:
                    consequence = (
                        "if it did, this process holds that attempt and has fenced off older writers"
                        if what == "attempt record" else "treat this save as not acknowledged"
                    )
                    raise CommitUnknownError(
                        f"{self.where(key)}: the {what} create failed {policy.attempts} times ({redact_text(str(exc))}); "
                        f"it may or may not have landed: {consequence}."
                    ) from exc
                policy.backoff(i)
                continue
            if created:
                return True
            # "Already exists": ours from a lost reply, or another writer's?
            try:
                existing = self.get_bounded(key, len(data))
            except (NotFoundError, StoreUnavailableError) as exc:
                if uncertain:
                    raise CommitUnknownError(
                        f"{self.where(key)}: the {what} exists but cannot be read back ({redact_text(str(exc))}); "
                        "its outcome is unknown. Treat this save as not acknowledged."
                    ) from exc
                raise
            return existing == data
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ put
    def put_hashed(self, key: str, data: Any) -> tuple[int, str]:
        """Stream ``data`` to ``key``, hashing it with BLAKE3 as it is written;
        (size, digest) of exactly the bytes handed to the backend. A transient
        failure is retried when the source can be replayed."""
        stream, _ = self._put_retried(data, lambda st: self.backend.put(key, st))
        return stream.size, stream.hexdigest()

    def _put_retried(self, data: Any, send: Callable[[HashingStream], T]) -> tuple[HashingStream, T]:
        """``send`` a fresh :class:`HashingStream` of ``data``; a transient
        failure is retried (with the run's backoff) when ``data`` can be replayed."""
        replayable = is_replayable(data)
        policy = self.retry
        for i in range(policy.attempts):
            stream = HashingStream(data)
            try:
                return stream, send(stream)
            except TransientError:
                if not replayable or i == policy.attempts - 1:
                    raise
                rewind(data)
                policy.backoff(i)
        raise AssertionError("unreachable")

    def put_hashed_deferred(self, key: str, data: Any) -> tuple[int, str, PendingPut]:
        """:meth:`put_hashed` through ``Backend.put_deferred``: the object is
        durable at ``key`` only once ``Backend.settle`` of the returned handle
        returned. Retried as :meth:`put_hashed` is."""
        stream, pending = self._put_retried(data, lambda st: self.backend.put_deferred(key, st))
        return stream.size, stream.hexdigest(), pending

    # ---------------------------------------------------------------- reads
    def iter_object(self, key: str, size: int, chunk: int = CHUNK) -> Iterator[bytes]:
        """The object in chunks, never reading more than ``size + 1`` bytes in
        all (the extra byte, when present, tells the caller the object grew).
        A short block ends the iteration: the object ended before ``size``
        (the caller's size check reports it), so a huge size claim costs one
        request past the real end, not one per chunk of the claim."""
        if size < chunk:
            data = self.get_bounded(key, size)
            self.bytes_read += len(data)
            yield data
            return
        for off in range(0, size, chunk):
            end = min(size, off + chunk)
            stop = size + 1 if end == size else end
            data = self.retry.call(partial(self.backend.get_range, key, off, stop))
            self.bytes_read += len(data)
            yield data
            if len(data) < end - off:
                return

    def hash_object(self, key: str, size: int, chunk: int = CHUNK) -> tuple[int, str]:
        """(bytes seen, BLAKE3) of the object, reading at most ``size + 1`` bytes.

        A large object is read into two reused buffers of ``chunk`` (+ 1)
        bytes, chunk *i + 1* read while chunk *i* is hashed in a helper
        thread; the buffers are anonymous mappings, handed back to the system
        once unused (a deep open leaves no heap of its reads behind for the
        restore after it to add to its peak). A short chunk ends the read."""
        if size < chunk:
            h = blake3.blake3()
            seen = 0
            for block in self.iter_object(key, size, chunk):
                seen += len(block)
                h.update(block)
            return seen, h.hexdigest()
        maps = [mmap.mmap(-1, chunk + 1), mmap.mmap(-1, chunk + 1)]
        views = [memoryview(m) for m in maps]
        hasher = BackgroundHasher(threads=hashing.READ_HASH_THREADS)
        seen = 0
        try:
            for i, off in enumerate(range(0, size, chunk)):
                stop = size + 1 if off + chunk >= size else off + chunk
                view = views[i % 2][: stop - off]  # its last hash finished when chunk i - 1 was fed
                got = self.retry.call(partial(self.backend.readinto, key, off, view))
                self.bytes_read += got
                seen += got
                hasher.feed(view[:got])
                if got < stop - off:
                    break
        finally:
            digest = hasher.finish()  # the mappings go back when their last view does (no close: a
            # helper thread may still hold a view for an instant after the hash finished)
        return seen, digest

    def verified_chunks(self, key: str, comp: ComponentEntry, label: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """Stream a component, verifying its size on every chunk and its digest
        at the end. The final chunk is yielded only after the whole component
        verified: a consumer that reaches the end has seen only verified bytes;
        on a mismatch :class:`CorruptionError` comes instead of the last chunk."""
        h = blake3.blake3()
        got = 0
        held: bytes | None = None
        try:
            for block in self.iter_object(key, comp.size, chunk):
                got += len(block)
                if got > comp.size:
                    break
                h.update(block)
                if held is not None:
                    yield held
                held = block
        except NotFoundError:
            raise CorruptionError(f"{self.where(key)}: {label} is missing") from None
        if got != comp.size:
            raise CorruptionError(
                f"{self.where(key)}: {label} has {got}{'+' if got > comp.size else ''} bytes, "
                f"the commit record says {comp.size}"
            )
        if h.hexdigest() != comp.blake3:
            raise CorruptionError(f"{self.where(key)}: {label} does not match its BLAKE3 digest")
        if held is not None:
            yield held

    def read_verified_into(self, key: str, comp: ComponentEntry, label: str, out: memoryview | Scatter,
                           chunk: int = CHUNK) -> None:
        """Fill ``out`` (exactly ``comp.size`` bytes: one view, or a
        :class:`Scatter` of many, e.g. one per tensor) with the component,
        verified: each span is read straight into ``out`` (up to the
        backend's ``read_concurrency`` spans at once; a span of small
        segments of a scatter is read once and copied out) and hashed, in
        order, in a helper thread while later spans are read; then the size
        (one byte past the end must not exist) and the digest are checked. On
        :class:`CorruptionError` the content of ``out`` is undefined."""
        dest = as_scatter(out)
        if len(dest) != comp.size:
            raise ValueError(f"buffer of {len(dest)} bytes for a component of {comp.size}")
        hasher = BackgroundHasher(threads=hashing.READ_HASH_THREADS)
        try:
            seen = self._fill_hashed(key, dest, chunk, hasher)
            grew = seen == comp.size and self._extends_past(key, comp.size)
        except NotFoundError:
            raise CorruptionError(f"{self.where(key)}: {label} is missing") from None
        finally:
            digest = hasher.finish()  # never leave a hash running on the caller's buffer
        if seen != comp.size or grew:
            n = f"{comp.size}+" if grew else str(seen)
            raise CorruptionError(f"{self.where(key)}: {label} has {n} bytes, the commit record says {comp.size}")
        if digest != comp.blake3:
            raise CorruptionError(f"{self.where(key)}: {label} does not match its BLAKE3 digest")

    def read_verified_parts_into(self, parts: Sequence[tuple[str, ComponentEntry, str]], out: memoryview | Scatter,
                                 chunk: int = CHUNK) -> None:
        """Fill ``out`` with the concatenation of several objects, each
        verified as :meth:`read_verified_into` does (its size, nothing past it,
        its digest): ``parts`` are (key, entry with the object's size and
        digest, label for messages), in order. Part *k + 1* is read while part
        *k* is hashed in a helper thread, so reading many small objects (the
        pieces of a component) costs what reading one large one does. A part
        larger than ``chunk`` is read by :meth:`read_verified_into`. On
        :class:`CorruptionError` the content of ``out`` is undefined; no hash
        is left running on it when this returns or raises."""
        dest = as_scatter(out)
        if sum(c.size for _, c, _ in parts) != len(dest):
            raise ValueError(f"buffer of {len(dest)} bytes for parts of {sum(c.size for _, c, _ in parts)}")
        live: builtins.list[tuple[BackgroundHasher, str, ComponentEntry, str]] = []

        def settle_one() -> None:
            hasher, key, comp, label = live.pop(0)
            if hasher.finish() != comp.blake3:
                raise CorruptionError(f"{self.where(key)}: {label} does not match its BLAKE3 digest")

        views: builtins.list[tuple[str, ComponentEntry, str, Scatter]] = []
        off = 0
        for key, comp, label in parts:
            views.append((key, comp, label, dest.sub(off, off + comp.size)))
            off += comp.size
        try:
            at = 0
            while at < len(views):
                key, comp, label, view = views[at]
                if comp.size > chunk:
                    while live:
                        settle_one()
                    self.read_verified_into(key, comp, label, view, chunk)
                    at += 1
                    continue
                run = [at]  # the small parts from here to the next large one, read concurrently
                while run[-1] + 1 < len(views) and views[run[-1] + 1][1].size <= chunk:
                    run.append(run[-1] + 1)
                at = run[-1] + 1
                with closing(self._read_parts([views[i] for i in run])) as arrived:
                    for (key, comp, label, _), got, hashed, grew in arrived:
                        self.bytes_read += got
                        if got != comp.size or grew:
                            n = f"{comp.size}+" if grew else str(got)
                            raise CorruptionError(
                                f"{self.where(key)}: {label} has {n} bytes, the commit record says {comp.size}")
                        hasher = BackgroundHasher(threads=hashing.READ_HASH_THREADS)
                        live.append((hasher, key, comp, label))
                        hasher.feed(hashed)
                        while len(live) > 1:
                            settle_one()
            while live:
                settle_one()
        finally:
            for hasher, *_ in live:
                hasher.finish()  # never leave a hash running on the caller's buffer

    def _read_parts(self, parts: Sequence[tuple[str, ComponentEntry, str, Scatter]]
                    ) -> Generator[tuple[tuple[str, ComponentEntry, str, Scatter], int, memoryview, bool], None, None]:
        """(part, bytes read, the bytes read, whether the object holds a byte past
        its recorded size) of each small part, read whole into its view, in order;
        up to the backend's ``objects_concurrency`` parts (at most 16) in flight (a
        cold disk and an object store both serve several reads at once faster than
        one after another). A missing object is :class:`CorruptionError`. Closing the
        iterator early waits for the reads in flight and cancels the rest, so no
        read is left writing into the caller's buffer."""
        def read(part: tuple[str, ComponentEntry, str, Scatter]) -> tuple[int, memoryview, bool]:
            key, comp, label, view = part
            try:
                got, hashed = self._read_span(key, view, 0, comp.size) if comp.size else (0, memoryview(b""))
                return got, hashed, got == comp.size and self._extends_past(key, comp.size)
            except NotFoundError:
                raise CorruptionError(f"{self.where(key)}: {label} is missing") from None

        with closing(_in_order(read, parts, self._objects_concurrency())) as done:  # closed with this one: no read left running
            for part, (got, hashed, grew) in done:
                yield part, got, hashed, grew

    def hash_objects(self, objects: Sequence[tuple[str, int]]
                     ) -> Generator[tuple[tuple[str, int], tuple[int, str] | None], None, None]:
        """``((key, size), (bytes seen, BLAKE3))`` of each object, as
        :meth:`hash_object` gives it, or ``None`` for one that is missing; in
        order, up to the backend's ``objects_concurrency`` at once (a deep check
        of a component's pieces). Closing it early waits for those in flight."""
        def one(obj: tuple[str, int]) -> tuple[int, str] | None:
            try:
                return self.hash_object(obj[0], obj[1])
            except NotFoundError:
                return None

        with closing(_in_order(one, objects, self._objects_concurrency())) as done:
            yield from done

    def _objects_concurrency(self) -> int:
        own = getattr(self.backend, "objects_concurrency", None)
        return int(own) if own is not None else int(getattr(self.backend, "read_concurrency", 1))

    def _read_span(self, key: str, dest: Scatter, start: int, end: int) -> tuple[int, memoryview]:
        """Read the object's bytes ``[start, end)`` into ``dest``'s bytes at the
        same offsets: (bytes read, a view of exactly the bytes read, for the
        hash). Straight into the memory when one segment holds the span; else
        once into a scratch buffer, then copied into each segment."""
        segs = dest.segments(start, end)
        if len(segs) == 1:
            got = self.retry.call(partial(self.backend.readinto, key, start, segs[0]))
            return got, segs[0][:got]
        scratch = memoryview(bytearray(end - start))
        got = self.retry.call(partial(self.backend.readinto, key, start, scratch))
        at = 0
        for s in segs:
            if at >= got:
                break
            n = min(len(s), got - at)
            s[:n] = scratch[at : at + n]
            at += n
        return got, scratch[:got]

    def _fill_hashed(self, key: str, dest: Scatter, chunk: int, hasher: BackgroundHasher) -> int:
        """Read the object's first ``len(dest)`` bytes into ``dest`` span by
        span (:meth:`Scatter.spans`), feeding each to ``hasher`` in order; the
        count of bytes before the first short span (``len(dest)`` when every
        span came back whole)."""
        with closing(self._read_spans(key, dest, dest.spans(chunk))) as arrived:
            for (start, end), got, hashed in arrived:
                self.bytes_read += got
                if got != end - start:
                    return start + got
                hasher.feed(hashed)
        return len(dest)

    def _read_spans(self, key: str, dest: Scatter, spans: builtins.list[tuple[int, int]]
                    ) -> Generator[tuple[tuple[int, int], int, memoryview], None, None]:
        """(span, bytes read, the bytes read) of each span of ``dest`` filled
        from the object, in order; up to the backend's ``read_concurrency``
        spans (at most 16) in flight. Closing the iterator early waits for the
        reads in flight and cancels the rest."""
        def read(span: tuple[int, int]) -> tuple[int, memoryview]:
            return self._read_span(key, dest, span[0], span[1])

        with closing(_in_order(read, spans, int(getattr(self.backend, "read_concurrency", 1)))) as done:
            for span, (got, hashed) in done:
                yield span, got, hashed

    def _extends_past(self, key: str, size: int) -> bool:
        """Whether the object holds a byte at offset ``size`` (it grew past its recorded size)."""
        return self.retry.call(partial(self.backend.readinto, key, size, memoryview(bytearray(1)))) > 0


_In = TypeVar("_In")
_Out = TypeVar("_Out")


def _in_order(fn: Callable[[_In], _Out], items: Sequence[_In], concurrency: int
              ) -> Generator[tuple[_In, _Out], None, None]:
    """``(item, fn(item))`` for each item, in order, with up to ``concurrency``
    calls (at most 16) in flight in helper threads (one: in this thread). An
    exception of ``fn`` is raised when its item's turn comes. Closing the
    generator early waits for the calls in flight and cancels the rest (none
    is left writing into a caller's buffer)."""
    conc = max(1, min(concurrency, 16, len(items)))
    if conc == 1:
        for item in items:
            yield item, fn(item)
        return
    pool = ThreadPoolExecutor(conc, thread_name_prefix="ckptstore-readinto")
    try:
        pending: deque[tuple[_In, Future[_Out]]] = deque()
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= conc:
                first, fut = pending.popleft()
                yield first, fut.result()
        while pending:
            first, fut = pending.popleft()
            yield first, fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
