"""Turning user data into chunk streams, and hashing them while they are written.

The hash runs in a helper thread on chunk *i* while the backend writes chunk
*i* (BLAKE3 and file writes both release the GIL), so the save reads the data
once and overlaps hashing with I/O instead of adding it.
"""

from __future__ import annotations

import bisect
import io
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import blake3

from ..errors import InvalidInputError

CHUNK = 8 * 1024 * 1024

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptstore-hash")
        return _pool


def as_buffer(obj: Any) -> memoryview | None:
    """A flat byte view of a bytes-like object, or None if it is not one."""
    if isinstance(obj, str):
        return None
    try:
        mv = memoryview(obj)
    except TypeError:
        return None
    if not mv.contiguous:
        raise InvalidInputError("component data must be contiguous in memory")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def is_replayable(data: Any) -> bool:
    """True when the data can be streamed again on a retry."""
    if as_buffer(data) is not None:
        return True
    return hasattr(data, "seek") and hasattr(data, "read") and getattr(data, "seekable", lambda: False)()


def describe_type(data: Any) -> str:
    return type(data).__module__ + "." + type(data).__qualname__


def check_data(data: Any) -> None:
    """Reject unusable data before anything is written."""
    if isinstance(data, str):
        raise InvalidInputError("component data is a str; encode it to bytes first (e.g. text.encode())")
    if as_buffer(data) is not None:
        return
    if hasattr(data, "read"):
        return
    if isinstance(data, (dict, set, int, float)) or data is None or not isinstance(data, Iterable):
        raise InvalidInputError(
            f"component data must be bytes-like, a binary file object or an iterable of buffers; "
            f"got {describe_type(data)}"
        )


def iter_chunks(data: Any, chunk: int | None = CHUNK) -> Iterator[memoryview]:
    """Yield the data as byte views of at most ``chunk`` bytes; with
    ``chunk=None``, each buffer whole (a file object in 8 MiB reads)."""

    def split(b: memoryview) -> Iterator[memoryview]:
        if chunk is None:
            yield b
            return
        for i in range(0, len(b), chunk):
            yield b[i : i + chunk]

    mv = as_buffer(data)
    if mv is not None:
        yield from split(mv)
        return
    if hasattr(data, "read"):
        while True:
            block = data.read(chunk or 1 << 23)
            if block is None:
                continue
            if isinstance(block, str):
                raise InvalidInputError("component file object is in text mode; open it with 'rb'")
            if not block:
                return
            yield memoryview(block)
    for i, item in enumerate(data):
        b = as_buffer(item)
        if b is None:
            raise InvalidInputError(f"component data item {i} is {describe_type(item)}, not a bytes-like buffer")
        yield from split(b)


def rewind(data: Any) -> None:
    if hasattr(data, "seek") and as_buffer(data) is None:
        data.seek(0, io.SEEK_SET)


#: BLAKE3's own threads (``max_threads``) for the hashes of verified reads
#: (a restore, a deep check): ``blake3.blake3.AUTO``, one per core, where
#: there is more than one. The hash of chunk *i* then takes the cores the read
#: of chunk *i + 1* leaves free, and on a machine shared with other work its
#: threads get their share of the cores (measured on 2 shared cores, load 11
#: to 14, 240 MiB resume: median 400 ms against 545 ms with one thread, the
#: same CPU time, docs/performance.md). Saves keep one thread: their hash
#: overlaps a write, which needs little CPU.
READ_HASH_THREADS = blake3.blake3.AUTO if (os.cpu_count() or 1) > 1 else 1

#: segments of a :class:`Scatter` smaller than this are read together (one read, then copied out)
SMALL_SEGMENT = 1 << 20


class Scatter:
    """One logical byte buffer made of several writable byte views, in order:
    a component read straight into many tensors' memory. Offsets are those of
    the concatenation; a view of length 0 is dropped."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = [v for v in views if len(v)]
        self.starts: list[int] = []
        at = 0
        for v in self.views:
            self.starts.append(at)
            at += len(v)
        self.size = at

    def __len__(self) -> int:
        return self.size

    def segments(self, start: int, end: int) -> list[memoryview]:
        """The views that hold bytes ``[start, end)``, cut to that range, in order."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"range [{start}, {end}) is outside a buffer of {self.size} bytes")
        out: list[memoryview] = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            v, at = self.views[i], self.starts[i]
            stop = min(end, at + len(v))
            out.append(v[start - at : stop - at])
            start = stop
            i += 1
        return out

    def sub(self, start: int, end: int) -> Scatter:
        """Bytes ``[start, end)`` as a scatter of their own (views of the same memory)."""
        return Scatter(self.segments(start, end))

    def spans(self, chunk: int) -> list[tuple[int, int]]:
        """Read units of at most ``chunk`` bytes that tile the buffer: a
        segment of at least :data:`SMALL_SEGMENT` bytes is cut from its own
        start (so each of its spans lands in it alone); consecutive smaller
        segments are grouped into one span (read once, then copied out),
        :data:`SMALL_SEGMENT` meaning at most ``chunk`` here. One view: the plain grid ``0, chunk, 2 * chunk, ...``."""
        out: list[tuple[int, int]] = []
        small = min(SMALL_SEGMENT, chunk)
        group = -1  # start of the open group of small segments
        for v, at in zip(self.views, self.starts, strict=True):
            n = len(v)
            if n < small and len(self.views) > 1:
                if group >= 0 and at + n - group > chunk:
                    out.append((group, at))
                    group = -1
                if group < 0:
                    group = at
                continue
            if group >= 0:
                out.append((group, at))
                group = -1
            out.extend((off, min(at + n, off + chunk)) for off in range(at, at + n, chunk))
        if group >= 0:
            out.append((group, self.size))
        return out


def as_scatter(out: memoryview | Scatter) -> Scatter:
    return out if isinstance(out, Scatter) else Scatter([out])


class BackgroundHasher:
    """BLAKE3 of a sequence of buffers, each hashed in a helper thread while
    the caller produces the next (reads it, or hands the previous one to a
    writer). A buffer passed to :meth:`feed` must stay unchanged until the next
    ``feed`` or :meth:`finish` returns. ``threads``: BLAKE3's own threads for
    each buffer (``max_threads``; see :data:`READ_HASH_THREADS`); the digest
    is the same whatever the count."""

    def __init__(self, *, threaded: bool = True, threads: int = 1) -> None:
        self._h = blake3.blake3(max_threads=threads)
        self._pool = _hash_pool() if threaded else None
        self._pending: Future[Any] | None = None

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def feed(self, view: memoryview) -> None:
        self._wait()
        if self._pool is not None and len(view) >= 1 << 20:
            self._pending = self._pool.submit(self._h.update, view)
        else:
            self._h.update(view)

    def finish(self) -> str:
        """Wait for the last buffer; the hex digest of everything fed."""
        self._wait()
        return self._h.hexdigest()


class HashingStream:
    """Iterates the chunks of ``data``, hashing each in a helper thread while the
    consumer (the backend) writes it. After exhaustion ``size`` and
    ``hexdigest()`` describe exactly the bytes that were yielded."""

    def __init__(self, data: Any, chunk: int = CHUNK, *, threaded: bool = True) -> None:
        self._data = data
        self._chunk = chunk
        self._hasher = BackgroundHasher(threaded=threaded)
        self._digest: str | None = None
        self.size = 0

    def __iter__(self) -> Iterator[memoryview]:
        try:
            for c in iter_chunks(self._data, self._chunk):
                self._hasher.feed(c)
                self.size += len(c)
                yield c
        finally:
            # a consumer that stops early (or fails) must not leave a hash running on its buffer
            digest = self._hasher.finish()
        self._digest = digest

    def hexdigest(self) -> str:
        if self._digest is None:
            raise RuntimeError("stream not fully consumed")
        return self._digest

