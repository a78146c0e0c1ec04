"""Peer-copy frames: how one rank's part of a save travels to another rank
(PROTOCOL.md §4.8 item 8, THREATS.md §4.16), and how a received part is
written into a tier, verified. No torch: the transport is a :class:`PeerLink`.

A frame is a header (magic, status, step, record length), the record bytes,
then the part's *objects* (:func:`frame_objects`), each in chunks of at most
:data:`CHUNK` bytes: every component of the sender's part in name order,
whole, or — a version-3 part — as its pieces in order, each distinct piece
once. Sizes, order and keys come from the record, never from the sender.

A frame of pieces is answered before any object: the receiver sends a *need*
reply (one byte per object, 1 to send it, 0 for a piece it already holds
intact; or "refused": nothing follows), and the sender then sends only the
objects asked for. So a frozen backbone crosses the link once, and a copy the
receiver refuses costs the record alone. A frame of whole components (a
version-1 or -2 part) has no reply: every object follows.

A sender whose own copy fails to read sends zeros for the rest of that object
(the frame stays in step; the receiver's digest refuses it)."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import blake3

from ..backends.base import PendingPut
from ..core.catalog import part_names
from ..core.piece_reads import check_present
from ..core.pieces import SETTLE_BATCH
from ..errors import CkptStoreError, CorruptionError
from ..protocol import CommitRecord, ComponentEntry, component_key
from ..protocol.layout import piece_key
from ..protocol.records import MAX_COMMIT_RECORD
from ..protocol.selection import SaveRef
from .durable_copy import commit_durable
from .local import LocalTier

__all__ = ["CHUNK", "Frame", "FrameObject", "PeerCopyError", "PeerLink", "Sent", "frame_objects", "receive_frame",
           "receive_part", "send_part"]

#: bytes per transfer of an object (a receive buffer of this size per peer frame)
CHUNK = 8 * 2**20
_MAGIC = 0x7370_6B63_7072_6565  # "eerpckps"
_HEADER = struct.Struct("<QQQQ")  # magic, status (1: a part follows, 0: nothing), step, record length
_SENDS, _NOTHING = 1, 0
_REPLY_MAGIC = 0x6465_656E_6B63_7073  # "spckneed"
_REPLY = struct.Struct("<QQQ")  # magic, status (1: a need list of count bytes follows, 0: refused), count
_NEED, _REFUSED = 1, 0


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


@dataclass(frozen=True)
class FrameObject:
    """One object of a part as it travels: where it lives in a tier folder, its
    size and BLAKE3 (a piece: its digest), and what to call it in messages."""

    key: str
    entry: ComponentEntry
    label: str
    #: (holder, digest) of a piece; None: a whole component
    piece: tuple[str, str] | None = None


def frame_objects(rec: CommitRecord, names: Sequence[str]) -> list[FrameObject]:
    """The objects of the part ``names`` of ``rec``, in frame order: each
    component in name order, whole, or (pieced) its pieces in order, each
    distinct piece once in the whole part. Both ends compute it from the record."""
    out: list[FrameObject] = []
    seen: set[tuple[str, str]] = set()
    for name in sorted(names):
        comp = rec.components[name]
        if comp.pieces is None:
            out.append(FrameObject(component_key(rec.run_id, rec.save_id, name), comp, repr(name)))
            continue
        for p in comp.pieces:
            hd = (p.holder, p.digest)
            if hd in seen:
                continue
            seen.add(hd)
            out.append(FrameObject(piece_key(rec.run_id, p.holder, p.digest), p.as_entry(),
                                   f"{name!r}, piece {p.digest[:16]}", hd))
    return out


@dataclass
class Sent:
    """What one :func:`send_part` did."""

    #: objects of the sender's own copy that could not be read (sent as zeros)
    failed: list[str] = field(default_factory=list)
    #: the receiver refused the frame before any object was sent (its reason is its own)
    refused: bool = False
    #: object bytes sent
    nbytes: int = 0


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
              read: Callable[[str, ComponentEntry], Iterator[bytes]], names: Sequence[str]) -> Sent:
    """One frame to ``dst``: the record and the objects of its part ``names``
    (each from ``read(key, entry)``, a verified stream of the sender's own
    copy), or "nothing" when ``record`` is None. A frame of pieces first
    receives the need reply and sends only what it asks for; a reply that is
    not one leaves the link out of step (:class:`PeerCopyError`)."""
    if record is None:
        link.send(dst, _HEADER.pack(_MAGIC, _NOTHING, step, 0))
        return Sent()
    link.send(dst, _HEADER.pack(_MAGIC, _SENDS, step, len(record)))
    link.send(dst, record)
    rec = CommitRecord.decode(record, "the record being sent")
    objects = frame_objects(rec, names)
    if any(o.piece is not None for o in objects):
        need = _receive_need(link, dst, len(objects))
        if need is None:
            return Sent(refused=True)
        objects = [o for o, n in zip(objects, need, strict=True) if n]
    out = Sent()
    for o in objects:
        for chunk in _exact(read(o.key, o.entry), o.entry.size, out.failed, o.label):
            link.send(dst, chunk)
        out.nbytes += o.entry.size
    return out


def _receive_need(link: PeerLink, src: int, count: int) -> list[bool] | None:
    """The need reply to a frame of ``count`` objects (None: refused); anything else is :class:`PeerCopyError`."""
    magic, status, n = _REPLY.unpack(link.recv(src, _REPLY.size))
    if magic != _REPLY_MAGIC or status not in (_NEED, _REFUSED) or (status == _REFUSED and n != 0):
        raise PeerCopyError(f"rank {src} answered a peer-copy frame with something that is not a reply; "
                            "the link is out of step")
    if status == _REFUSED:
        return None
    if n != count:
        raise PeerCopyError(f"rank {src} answered a frame of {count} objects about {n}; the link is out of step")
    body = link.recv(src, n)
    if any(b > 1 for b in body):
        raise PeerCopyError(f"rank {src} sent a need reply that is not one; the link is out of step")
    return [b == 1 for b in body]


class Frame:
    """A frame being received: its record and the objects still to come.
    Whatever the caller does with an object's stream, the frame stays in step:
    the rest of a stream left unfinished is received (and dropped) before the
    next object, and :meth:`drain` receives what is left (a frame of pieces
    not answered yet is refused: nothing more comes)."""

    def __init__(self, link: PeerLink, src: int, step: int, data: bytes, record: CommitRecord,
                 names: list[str]) -> None:
        self.link, self.src, self.step, self.data, self.record, self.names = link, src, step, data, record, names
        #: every object of the part, in frame order
        self.objects = frame_objects(record, names)
        #: a frame of pieces waits for :meth:`reply` before any object comes
        self.pieced = any(o.piece is not None for o in self.objects)
        self.replied = not self.pieced
        self._coming: list[FrameObject] = [] if self.pieced else list(self.objects)
        #: bytes still to come per object (cut as :func:`_chunk_sizes` cuts them, one chunk at a time:
        #: what a record claims costs no memory before anything of it arrived)
        self._left = [o.entry.size for o in self._coming]
        self._i = 0

    def reply(self, need: Sequence[bool] | None) -> None:
        """A frame of pieces: which of :attr:`objects` the sender is to send
        (None: none, the copy is refused). Once, before :meth:`incoming`."""
        if self.replied:
            raise PeerCopyError("a peer-copy frame was answered twice")
        self.replied = True
        if need is None:
            self.link.send(self.src, _REPLY.pack(_REPLY_MAGIC, _REFUSED, 0))
            return
        if len(need) != len(self.objects):
            raise PeerCopyError(f"a need reply of {len(need)} entries for a frame of {len(self.objects)} objects")
        self.link.send(self.src, _REPLY.pack(_REPLY_MAGIC, _NEED, len(need)))
        self.link.send(self.src, bytes(1 if n else 0 for n in need))
        self._coming = [o for o, n in zip(self.objects, need, strict=True) if n]
        self._left = [o.entry.size for o in self._coming]

    def incoming(self) -> Iterator[tuple[FrameObject, Iterator[bytes]]]:
        """Each object that will arrive, in frame order, with a stream of its chunks."""
        if not self.replied:
            raise PeerCopyError("a frame of pieces must be answered (Frame.reply) before its objects are read")
        while self._i < len(self._coming):
            i = self._i
            yield self._coming[i], self._chunks(i)
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
        """Receive (and drop) whatever of the frame was not consumed; refuse a frame of pieces not answered yet."""
        if not self.replied:
            self.reply(None)
        for i in range(self._i, len(self._coming)):
            self._skip(i)
        self._i = len(self._coming)


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


def receive_part(frame: Frame, tier: LocalTier,
                 need: Callable[[Sequence[FrameObject]], Sequence[bool]] | None = None) -> SaveRef:
    """Write ``frame``'s part into ``tier`` (a peer folder, or the owner's own
    folder on a write-back), every object verified on the way, then create
    the record bytes with the tier's atomic commit after the fences of its
    attempt mirror (:func:`~ckptstore.tiers.durable_copy.commit_durable`: the
    one commit sequence). A frame of pieces is answered first with ``need``
    (which objects to send; default: every one), and every piece of the part
    must then be in ``tier`` with its size (those not sent included) before
    the commit. New objects are made durable together before the commit
    (``put_deferred`` and ``settle``, in batches). Raises
    :class:`CorruptionError` (an object that does not verify: nothing of it
    lands; the frame is drained), :class:`~ckptstore.errors.SaveAbortedError`
    (a piece not sent is missing) or the tier's errors; the frame is always
    consumed whole."""
    rec = frame.record
    io = tier.io
    landed: list[PendingPut] = []
    try:
        if not frame.replied:
            frame.reply(list(need(frame.objects)) if need is not None else [True] * len(frame.objects))
        for obj, chunks in frame.incoming():
            label = f"rank {frame.src}'s copy of {obj.label} (step {rec.step})"
            # once: the stream cannot be replayed (a failed write fails the copy, the frame is drained)
            landed.append(io.backend.put_deferred(obj.key, _verified(chunks, obj.entry, label)))
            if len(landed) >= SETTLE_BATCH:
                io.backend.settle(landed)
                landed = []
        io.backend.settle(landed)
        landed = []
    except BaseException:
        frame.drain()
        if landed:  # what verified is complete: settled (or closed) anyway, best effort
            try:
                io.backend.settle(landed)
            except Exception:  # noqa: BLE001 - the copy failed already; its error is the one raised
                pass
        raise
    if frame.pieced:
        check_present(io, {n: rec.components[n] for n in frame.names}, rec.save_id)
    ref = SaveRef.of(rec)
    commit_durable(io, tier.attempts, ref)
    return ref
