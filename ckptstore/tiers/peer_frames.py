"""Peer-copy frames: how one rank's part of a save travels to another rank
(PROTOCOL.md §4.8 item 8, THREATS.md §4.16), and how a received part is
written into a tier, verified. No torch: the transport is a :class:`PeerLink`.

A frame is a header (magic, status, step, record length), the record bytes,
then each component of the sender's part, in name order, in chunks of at
most :data:`CHUNK` bytes. The component sizes and order come from the record,
never from the sender; a sender whose own copy fails to read sends zeros for
the rest of that component (the frame stays in step; the receiver's digest
refuses it)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import blake3

from ..core.catalog import part_names
from ..errors import CkptStoreError, CorruptionError
from ..protocol import CommitRecord, ComponentEntry, component_key
from ..protocol.records import MAX_COMMIT_RECORD
from ..protocol.selection import SaveRef
from .local import LocalTier
from .replicator import commit_durable

__all__ = ["CHUNK", "Frame", "PeerCopyError", "PeerLink", "receive_frame", "receive_part", "send_part"]

#: bytes per transfer of a component (a receive buffer of this size per peer frame)
CHUNK = 8 * 2**20
_MAGIC = 0x7370_6B63_7072_6565  # "eerpckps"
_HEADER = struct.Struct("<QQQQ")  # magic, status (1: a part follows, 0: nothing), step, record length
_SENDS, _NOTHING = 1, 0


class PeerCopyError(CkptStoreError):
    """A peer copy could not be sent, received or verified (the next source is used)."""


class PeerLink(Protocol):
    """The transport between the ranks of one job (blocking, ordered per pair)."""

    #: this process's rank
    rank: int

    def send(self, dst: int, data: bytes | bytearray | memoryview) -> None:
        """Send ``data`` to rank ``dst`` (returns once it was taken)."""

    def recv(self, src: int, n: int) -> bytes:
        """Exactly ``n`` bytes from rank ``src``; :class:`PeerCopyError` when it does not answer in time."""


def _chunk_sizes(size: int) -> Iterator[int]:
    off = 0
    while off < size:
        n = min(CHUNK, size - off)
        yield n
        off += n


def _exact(source: Iterator[bytes], size: int, failed: list[str], name: str) -> Iterator[bytes]:
    """``source`` cut into the frame's chunks (:func:`_chunk_sizes`), exactly
    ``size`` bytes in all; when it fails, ends short or runs long, zeros stand
    for the rest (the reason appended to ``failed``: the receiver's digest
    refuses the component, the frame stays in step). Never holds more than
    one chunk and one block."""
    buf = bytearray()
    sent = 0
    why: str | None = None
    try:
        for block in source:
            if sent + len(buf) + len(block) > size:
                why = f"{name}: longer than its recorded size"
                break
            buf += block
            while len(buf) >= CHUNK:
                yield bytes(buf[:CHUNK])
                del buf[:CHUNK]
                sent += CHUNK
    except (CkptStoreError, OSError) as exc:
        why = f"{name}: {type(exc).__name__}: {exc}"[:300]
    if why is None and sent + len(buf) < size:
        why = f"{name}: shorter than its recorded size"
    if why is not None:
        failed.append(why)
    left = size - sent
    if buf and why is None:
        yield bytes(buf)  # the last, short chunk
        return
    zeros = bytes(min(CHUNK, left)) if why is not None else b""
    for n in _chunk_sizes(left):  # a failed component: zeros for the rest (its first chunk may be partly real)
        if buf:
            yield bytes(buf[:n]) + bytes(n - len(buf[:n]))
            buf = bytearray()
        else:
            yield zeros[:n]


def send_part(link: PeerLink, dst: int, step: int, record: bytes | None,
              read: Callable[[str, ComponentEntry], Iterator[bytes]], names: Sequence[str]) -> list[str]:
    """One frame to ``dst``: the record and the components ``names`` of it
    (each from ``read(name, entry)``, a verified stream), or "nothing" when
    ``record`` is None. Returns what could not be read (sent as zeros)."""
    if record is None:
        link.send(dst, _HEADER.pack(_MAGIC, _NOTHING, step, 0))
        return []
    link.send(dst, _HEADER.pack(_MAGIC, _SENDS, step, len(record)))
    link.send(dst, record)
    rec = CommitRecord.decode(record, "the record being sent")
    failed: list[str] = []
    for name in sorted(names):
        entry = rec.components[name]
        for chunk in _exact(read(name, entry), entry.size, failed, name):
            link.send(dst, chunk)
    return failed


class Frame:
    """A frame being received: its record and the components still to come.
    Whatever the caller does with a component's stream, the frame stays in
    step: the rest of a stream left unfinished is received (and dropped)
    before the next component, and :meth:`drain` receives what is left."""

    def __init__(self, link: PeerLink, src: int, step: int, data: bytes, record: CommitRecord,
                 names: list[str]) -> None:
        self.link, self.src, self.step, self.data, self.record, self.names = link, src, step, data, record, names
        #: bytes still to come per component (cut as :func:`_chunk_sizes` cuts them, one chunk at a time:
        #: what a record claims costs no memory before anything of it arrived)
        self._left = [record.components[n].size for n in names]
        self._i = 0

    def components(self) -> Iterator[tuple[str, ComponentEntry, Iterator[bytes]]]:
        """Each component in frame order with a stream of its chunks."""
        while self._i < len(self.names):
            i = self._i
            name = self.names[i]
            yield name, self.record.components[name], self._chunks(i)
            self._skip(i)
            self._i = i + 1

    def _next(self, i: int) -> int:
        n = min(CHUNK, self._left[i])
        self._left[i] -= n
        return n

    def _chunks(self, i: int) -> Iterator[bytes]:
        while self._left[i] > 0:
            yield self.link.recv(self.src, self._next(i))

    def _skip(self, i: int) -> None:
        while self._left[i] > 0:
            self.link.recv(self.src, self._next(i))

    def drain(self) -> None:
        """Receive (and drop) whatever of the frame was not consumed."""
        for i in range(self._i, len(self.names)):
            self._skip(i)
        self._i = len(self.names)


def receive_frame(link: PeerLink, src: int, owner: int, run_id: str) -> Frame | None:
    """The next frame from ``src`` holding rank ``owner``'s part; None for a
    "nothing new" frame. A frame that is not one (a bad magic, a record that
    does not decode or is not canonical) leaves the link out of step:
    :class:`PeerCopyError` (the caller stops using the link)."""
    head = link.recv(src, _HEADER.size)
    magic, status, step, length = _HEADER.unpack(head)
    if magic != _MAGIC or status not in (_SENDS, _NOTHING) or length > MAX_COMMIT_RECORD:
        raise PeerCopyError(f"rank {src} sent something that is not a peer-copy frame; the link is out of step")
    if status == _NOTHING:
        return None
    data = link.recv(src, length)
    try:
        rec = CommitRecord.decode(data, f"the record rank {src} sent", run_id=run_id)
    except CorruptionError as exc:
        raise PeerCopyError(f"rank {src} sent a record that does not decode ({exc}); the link is out of step") from None
    if rec.encode() != data:
        raise PeerCopyError(f"rank {src} sent a record not in canonical form; the link is out of step")
    mine = part_names(rec, owner)
    names = sorted(mine if mine is not None else rec.components)
    return Frame(link, src, step, data, rec, names)


def _verified(chunks: Iterator[bytes], entry: ComponentEntry, label: str) -> Iterator[bytes]:
    """``chunks`` passed on, hashed; the last one only after the whole matched ``entry``."""
    h = blake3.blake3()
    held: bytes | None = None
    got = 0
    for block in chunks:
        got += len(block)
        h.update(block)
        if held is not None:
            yield held
        held = block
    if got != entry.size or h.hexdigest() != entry.blake3:
        raise CorruptionError(f"{label} does not match its BLAKE3 digest")
    if held is not None:
        yield held


def receive_part(frame: Frame, tier: LocalTier) -> SaveRef:
    """Write ``frame``'s part into ``tier`` (a peer folder, or the owner's own
    folder on a write-back), every component verified on the way, then create
    the record bytes with the tier's atomic commit after the fences of its
    attempt mirror (:func:`~ckptstore.tiers.replicator.commit_durable`: the
    one commit sequence). Raises :class:`CorruptionError` (a component that
    does not verify: nothing of it lands; the frame is drained) or the
    tier's errors; the frame is always consumed whole."""
    rec = frame.record
    io = tier.io
    try:
        for name, entry, chunks in frame.components():
            label = f"rank {frame.src}'s copy of {name!r} (step {rec.step})"
            # once: the stream cannot be replayed (a failed write fails the copy, the frame is drained)
            io.backend.put(component_key(io.run_id, rec.save_id, name), _verified(chunks, entry, label))
    except BaseException:
        frame.drain()
        raise
    ref = SaveRef.of(rec)
    commit_durable(io, tier.attempts, ref)
    return ref
