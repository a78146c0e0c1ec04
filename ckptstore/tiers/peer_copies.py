"""Peer copies: each rank's local part of a save also held by ``k`` ranks on
other nodes (``docs/tiers.md`` "Peer copies", PROTOCOL.md §4.8 item 8, THREATS.md §4.16).

This module is the storage and framing side; it imports no torch. The
transport is a :class:`PeerLink` (two calls: send bytes to a rank, receive
``n`` bytes from a rank), implemented on ``torch.distributed`` point-to-point
over a dedicated gloo group by :mod:`ckptstore.distributed.peer_link`.

* **Who holds whom** (:func:`assign_receivers`): the ranks are grouped by
  node (a host: torchrun's ``GROUP_RANK``, else the host name, or
  ``TierOptions.node``); rank ``r``, the ``i``-th rank of its node, sends its
  part to the ``i``-th rank (modulo that node's count) of each of the next
  ``k`` nodes in name order. One node: no peers.
* **Where** (:func:`~ckptstore.tiers.tier_dir.peer_folder`): rank ``h`` keeps
  its copy of rank ``s``'s parts in ``<local_tier>/rank-<h>/.peers/rank-<s>``,
  a tier folder of its own (the run's ``RUN.json`` and attempt records mirrored
  from the durable tier, ``saves/``, ``commits/``), opened without following
  links, holding rank ``s``'s part of each save under the same commit record
  bytes as every other rank's local commit and the durable one.
* **Each acknowledged save** (:class:`PeerCopies`): every rank's background
  thread takes the saves in the order they were acknowledged (the same on
  every rank) and walks the job's copy pairs ``(sender, receiver)`` in one
  global order, sending its part where it is the sender and receiving where
  it is the receiver; with blocking transfers in one total order no two ranks
  can wait on each other in a cycle. A frame is a header (magic, status,
  step, record length), the record bytes, then each component of the
  sender's part, in name order, in chunks of at most :data:`CHUNK` bytes. The
  receiver requires the record bytes it committed itself for that save, hashes
  every component while writing it into the peer folder (the last chunk reaches
  the file only after the digest matched, as every verified copy in this
  package), creates the record with the local atomic commit after the fences
  of its mirror, and trims the folder to the local tier's ``keep``. A sender
  whose own copy fails to read sends zeros for the rest of that component (the
  frame stays in step; the receiver's digest refuses it). A thread that falls
  behind sends "nothing new" frames for the saves it skips (newest wins).
* **Resume** (:func:`plan_repair`, :func:`peer_holdings`, :func:`receive_part`):
  before the job's attempt is registered, every rank reports the parts it holds
  verified in its own folder and in its peer folders; the newest save of which
  every rank's part is held somewhere is chosen, the ranks lacking their part
  receive it from a holder and write it back into their own folder (verified
  on the way), and the job's usual all-ranks-or-none decision follows, which
  re-hashes every part again and judges every copy by the durable attempt
  records. A copy that fails anywhere on that way is not used: that rank does
  not hold the save, and the job falls back to an older save every rank holds,
  else to the durable tier.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import blake3

from ..backends.schemes import backend_from_url
from ..core.binding import read_run_record
from ..core.bounded_io import RunIO
from ..core.catalog import Catalog, part_names
from ..core.fencing import AttemptLog
from ..core.record_auth import RecordAuth
from ..errors import CkptStoreError, CorruptionError, InvalidInputError, NotFoundError
from ..protocol import AttemptRecord, CommitRecord, ComponentEntry, attempt_key, component_key, run_record_key
from ..protocol.records import MAX_COMMIT_RECORD
from ..protocol.selection import SaveRef, superseded_by
from ..retry import RetryPolicy
from .local import MAX_RUN_RECORD, LocalTier
from .parts import local_holdings
from .replicator import PeerStatus, commit_durable
from .tier_dir import PEERS, open_tier_dir, peer_folder

__all__ = [
    "CHUNK", "PeerCopies", "PeerCopyError", "PeerLink", "PeerStatus", "RepairPlan", "assign_receivers", "copy_pairs",
    "node_name", "peer_holdings", "plan_repair", "receive_part", "send_part",
]

#: bytes per transfer of a component (a receive buffer of this size per peer frame)
CHUNK = 8 * 2**20
#: peer folders of one rank looked at, at most, when it reports what it holds
MAX_PEER_FOLDERS = 8
#: acknowledged saves waiting for the copy thread at most; beyond it the oldest are skipped (newest wins)
MAX_WAITING = 2
_MAGIC = 0x7370_6B63_7072_6565  # "eerpckps"
_HEADER = struct.Struct("<QQQQ")  # magic, status (1: a part follows, 0: nothing), step, record length
_SENDS, _NOTHING = 1, 0
_PEER_NAME = re.compile(r"rank-(0|[1-9][0-9]{0,8})")


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


def node_name(explicit: str | None = None) -> str:
    """This process's node: ``explicit`` (``TierOptions.node``), else torchrun's
    node rank (``GROUP_RANK``), else the host name."""
    if explicit:
        return str(explicit)
    group = os.environ.get("GROUP_RANK")
    if group is not None and group.isdigit():
        return f"group-{int(group)}"
    return socket.gethostname() or "localhost"


def assign_receivers(nodes: Mapping[int, str], k: int) -> dict[int, tuple[int, ...]]:
    """Sender rank -> the ranks that hold a copy of its part (see the module
    docstring). ``k`` is capped at the number of other nodes; one node: no
    receivers. Deterministic from ``nodes`` alone (every rank computes it)."""
    if k < 0:
        raise InvalidInputError("TierOptions.peer_copies must be >= 0")
    by_node: dict[str, list[int]] = {}
    for r in sorted(nodes):
        by_node.setdefault(str(nodes[r]), []).append(r)
    order = sorted(by_node)
    k = min(k, len(order) - 1)
    out: dict[int, tuple[int, ...]] = {}
    for n_i, name in enumerate(order):
        for i, r in enumerate(by_node[name]):
            peers = []
            for j in range(1, k + 1):
                there = by_node[order[(n_i + j) % len(order)]]
                peers.append(there[i % len(there)])
            out[r] = tuple(peers)
    return out


def copy_pairs(receivers: Mapping[int, Sequence[int]]) -> list[tuple[int, int]]:
    """Every (sender, receiver) pair of one save's copies, in the one order every rank walks them."""
    return sorted((s, h) for s, hs in receivers.items() for h in hs)


# --------------------------------------------------------------------- frames
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


# --------------------------------------------------------------------- resume
def peer_holdings(local_tier: str | os.PathLike[str], run_id: str, holder: int, identity_digest: str,
                  auth: RecordAuth) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """What rank ``holder`` holds verified of other ranks' parts: sender ->
    the newest commits whose part for that sender verifies (as
    :func:`~ckptstore.tiers.parts.local_holdings`), from at most
    :data:`MAX_PEER_FOLDERS` folders ``rank-<holder>/.peers/rank-<s>``; and the
    reasons for what was not usable. Never raises (a link, a foreign folder
    name, an unreadable folder: reported, not followed)."""
    out: dict[int, list[dict[str, Any]]] = {}
    reasons: list[str] = []
    try:
        backend = open_tier_dir(local_tier, holder, create=False)
    except CkptStoreError as exc:
        return out, [f"rank {holder}: peer copies: {exc}"[:300]]
    if backend is None:
        return out, reasons
    try:
        top = os.path.join(backend.root, PEERS)
        if not backend.ops.exists(top):
            return out, reasons
        fd = backend.ops.open_directory(top)
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
    except (CkptStoreError, OSError) as exc:
        backend.close()
        return out, [f"rank {holder}: peer copies unreadable: {exc}"[:300]]
    backend.close()
    looked = 0
    for name in names:
        m = _PEER_NAME.fullmatch(name)
        if m is None or int(m.group(1)) == holder:
            reasons.append(f"rank {holder}: {PEERS}/{name[:64]!r} is not a peer folder; ignored")
            continue
        if looked >= MAX_PEER_FOLDERS:
            reasons.append(f"rank {holder}: more than {MAX_PEER_FOLDERS} peer folders; the rest not looked at")
            break
        looked += 1
        sender = int(m.group(1))
        held, why = local_holdings(local_tier, run_id, sender, identity_digest, auth,
                                   folder=peer_folder(holder, sender))
        reasons += [f"peer copy held by rank {holder}: {w}"[:300] for w in why[:5]]
        if held:
            out[sender] = held
    return out, reasons[:20]


def _live(k: tuple[int, int, str, str], attempts: Mapping[int, AttemptRecord] | None) -> bool:
    return attempts is None or superseded_by(k[0], k[1], attempts) is None


def durable_attempts(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, run_id: str,
                     auth: RecordAuth, retry: RetryPolicy | None) -> dict[int, AttemptRecord]:
    """The durable tier's effective attempt records (what :func:`plan_repair` judges zombies by);
    the durable tier's errors raise (the caller plans nothing then: fail closed)."""
    backend = backend_from_url(url, storage_options=storage_options)
    try:
        return dict(AttemptLog(RunIO(backend, run_id, retry), auth).load().effective)
    finally:
        backend.close()


def _key(h: Mapping[str, Any]) -> tuple[int, int, str, str] | None:
    step, attempt, sid, digest = h.get("step"), h.get("attempt"), h.get("save_id"), h.get("manifest_digest")
    if isinstance(step, int) and isinstance(attempt, int) and isinstance(sid, str) and isinstance(digest, str):
        return step, attempt, sid, digest
    return None


@dataclass(frozen=True)
class RepairPlan:
    """The save every rank's part is held of somewhere, and who sends which part."""

    #: (step, attempt, save ID, manifest digest) of the save
    target: tuple[int, int, str, str]
    #: rank lacking its part -> the rank that holds a peer copy of it
    fetch: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        step, attempt, sid, digest = self.target
        return {"step": step, "attempt": attempt, "save_id": sid, "manifest_digest": digest,
                "fetch": {str(r): h for r, h in sorted(self.fetch.items())}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RepairPlan:
        key = _key(d)
        fetch = d.get("fetch")
        if key is None or not isinstance(fetch, Mapping):
            raise PeerCopyError("the coordinator's repair plan is malformed")
        return cls(key, {int(r): int(h) for r, h in fetch.items()})


def plan_repair(own: Mapping[int, Sequence[Mapping[str, Any]]],
                peers: Mapping[int, Mapping[int, Sequence[Mapping[str, Any]]]], world_size: int,
                attempts: Mapping[int, AttemptRecord] | None = None,
                ) -> tuple[RepairPlan | None, int | None, int | None]:
    """The newest save of which every rank's part is held verified somewhere
    (``own``: rank -> what its own folder holds; ``peers``: holder -> sender ->
    what its peer folder of that sender holds), with a holder for each rank
    that lacks it in its own folder (the lowest-numbered holder); None when
    no save is held whole or no rank lacks its part. Also: the newest step of
    which every part is held somewhere (what a resume from the local tiers
    could reach), and the newest step any rank holds any part of (the newest
    save the job is known to have made: what ``steps_lost_with_local_tier``
    counts from), each None when there is none. ``attempts``: the durable
    tier's effective attempt records; a save a later attempt superseded there
    (a zombie's) is neither planned nor counted."""
    have: dict[int, dict[tuple[int, int, str, str], int | None]] = {r: {} for r in range(world_size)}
    for r, held in own.items():
        for h in held:
            k = _key(h)
            if k is not None and r in have and _live(k, attempts):
                have[r][k] = None
    for holder, senders in sorted(peers.items()):
        for s, held in senders.items():
            if s not in have or s == holder:
                continue
            for h in held:
                k = _key(h)
                if k is not None and k not in have[s] and _live(k, attempts):
                    have[s][k] = holder
    candidates: set[tuple[int, int, str, str]] = set()
    for v in have.values():
        candidates |= set(v)
    anywhere = max((k[0] for k in candidates), default=None)
    for k in sorted(candidates, reverse=True):
        if all(k in have[r] for r in have):
            fetch = {r: who for r in have if (who := have[r][k]) is not None}
            return (RepairPlan(k, fetch) if fetch else None), k[0], anywhere
    return None, None, anywhere


# ------------------------------------------------------------- status, copies
@dataclass
class _Pair:
    peer: int
    role: str
    last_step: int | None = None
    copies: int = 0
    nbytes: int = 0
    skipped: int = 0
    failures: int = 0
    last_error: str | None = None

    def view(self, stopped: bool) -> PeerStatus:
        return PeerStatus(self.peer, self.role, self.last_step, self.copies, self.nbytes, self.skipped,
                          self.failures, self.last_error, stopped)


class PeerCopies:
    """This rank's side of the peer copies of a job (see the module docstring):
    a daemon thread fed with each acknowledged save (:meth:`submit`), never
    blocking the caller. ``read(ref, name, entry)`` streams a component of
    this rank's own local copy of ``ref``, verified; ``folder(sender)`` opens
    the peer folder this rank keeps of ``sender``'s parts (its records
    mirrored); ``record`` writes a ledger event (best effort)."""

    def __init__(self, link: PeerLink, receivers: Mapping[int, Sequence[int]], *, run_id: str,
                 read: Callable[[SaveRef, str, ComponentEntry], Iterator[bytes]],
                 folder: Callable[[int], LocalTier], keep: int,
                 record: Callable[[str, Mapping[str, Any]], None]) -> None:
        self.link, self.rank, self.run_id = link, link.rank, run_id
        self.pairs = copy_pairs(receivers)
        self._read, self._folder, self.keep, self._record = read, folder, keep, record
        self._status = {("sends-to", h): _Pair(h, "sends-to") for s, h in self.pairs if s == self.rank}
        self._status |= {("receives-from", s): _Pair(s, "receives-from") for s, h in self.pairs if h == self.rank}
        self._tiers: dict[int, LocalTier] = {}
        self._queue: queue.Queue[SaveRef | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self.stopped: str | None = None
        self._thread = threading.Thread(target=self._run, name="ckptstore-peers", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether this rank takes part in any copy pair."""
        return bool(self._status)

    def submit(self, ref: SaveRef) -> None:
        """``ref`` was acknowledged on every rank: copy its parts (in the background)."""
        with self._lock:
            self._busy += 1
        self._queue.put(ref)

    def status(self) -> tuple[PeerStatus, ...]:
        with self._lock:
            return tuple(p.view(self.stopped is not None) for _, p in sorted(self._status.items(),
                                                                              key=lambda kv: (kv[0][0], kv[0][1])))

    def flush(self, timeout: float | None) -> bool:
        """Wait until every submitted save was handled (copied, skipped or failed); False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the saves already submitted (bounded by ``timeout``; the thread is a daemon)."""
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout=0.5)
        for tier in self._tiers.values():
            with contextlib.suppress(Exception):
                tier.backend.close()

    # ------------------------------------------------------------ the thread
    def _done(self, n: int = 1) -> None:
        with self._idle:
            self._busy -= n
            self._idle.notify_all()

    def _run(self) -> None:
        while True:
            ref = self._queue.get()
            if ref is None:
                return
            behind = self._queue.qsize() >= MAX_WAITING  # newer saves wait: this one's turn is "nothing new"
            try:
                if self.stopped is None and self.active:
                    self._round(ref, send=not behind)
            except BaseException as exc:  # noqa: BLE001 - the link is out of step: stop copying, say so
                self._stop(f"{type(exc).__name__}: {exc}"[:500], ref)
            finally:
                self._done()

    def _stop(self, why: str, ref: SaveRef) -> None:
        with self._lock:
            self.stopped = why
            for p in self._status.values():
                p.last_error = why
                p.failures += 1
        with contextlib.suppress(Exception):
            self._record("peer-copy-stopped", {"rank": self.rank, "step": ref.step, "why": why})

    def _round(self, ref: SaveRef, *, send: bool) -> None:
        rec_bytes = ref.record.encode()
        mine = part_names(ref.record, self.rank)
        for s, h in self.pairs:
            if s == self.rank:
                p = self._status[("sends-to", h)]
                names = sorted(mine if mine is not None else ref.record.components)
                def read(n: str, e: ComponentEntry) -> Iterator[bytes]:
                    return self._read(ref, n, e)

                if not send:
                    send_part(self.link, h, ref.step, None, read, names)
                    with self._lock:
                        p.skipped += 1
                    continue
                failed = send_part(self.link, h, ref.step, rec_bytes, read, names)
                with self._lock:
                    p.last_step = ref.step
                    p.copies += 1
                    p.nbytes += sum(ref.record.components[n].size for n in names)
                    if failed:
                        p.failures += 1
                        p.last_error = f"own copy unreadable, sent as zeros: {failed[0]}"
            elif h == self.rank:
                self._receive(s, ref, rec_bytes)

    def _receive(self, sender: int, ref: SaveRef, expect: bytes) -> None:
        p = self._status[("receives-from", sender)]
        frame = receive_frame(self.link, sender, sender, self.run_id)
        if frame is None:
            with self._lock:
                p.skipped += 1
            return
        if frame.data != expect:
            frame.drain()
            with self._lock:
                p.failures += 1
                p.last_error = f"step {frame.step}: the record sent is not the save acknowledged here; not kept"
            return
        try:
            tier = self._tiers.get(sender)
            if tier is None:
                try:
                    tier = self._tiers[sender] = self._folder(sender)
                except BaseException:
                    frame.drain()  # the frame stays in step whatever happened here
                    raise
            receive_part(frame, tier)
            tier.gc(keep_last=self.keep)
        except (CkptStoreError, OSError) as exc:
            why = f"step {ref.step}: {type(exc).__name__}: {exc}"[:500]
            with self._lock:
                p.failures += 1
                p.last_error = why
            with contextlib.suppress(Exception):
                self._record("peer-copy-failed", {"rank": self.rank, "from": sender, "step": ref.step, "why": why})
            return
        with self._lock:
            p.last_step = ref.step
            p.copies += 1
            p.nbytes += sum(frame.record.components[n].size for n in frame.names)


def open_peer_folder(local_tier: str | os.PathLike[str], holder: int, sender: int, run_id: str,
                     durable_attempts: AttemptLog, identity_digest: str, auth: RecordAuth,
                     retry: RetryPolicy | None, durable_url: str) -> LocalTier:
    """The peer folder rank ``holder`` keeps of rank ``sender``'s parts, as a
    tier holding ``sender``'s part (created, without following links)."""
    return LocalTier(local_tier, run_id, durable_attempts, identity_digest, auth, retry, part=sender,
                     durable_url=durable_url, folder=peer_folder(holder, sender))


def read_durable_records(durable: RunIO, attempt: int) -> tuple[bytes, bytes]:
    """The durable run record and attempt record ``attempt`` (bytes, bounded): what
    a write-back mirrors into the owner's folder before it holds a part there."""
    return (durable.get_bounded(run_record_key(durable.run_id), MAX_RUN_RECORD),
            durable.get_bounded(attempt_key(durable.run_id, attempt), MAX_RUN_RECORD))


def send_held_part(link: PeerLink, dst: int, local_tier: str | os.PathLike[str], holder: int, owner: int,
                   run_id: str, step: int, attempt: int, identity_digest: str, auth: RecordAuth) -> list[str]:
    """Rank ``holder`` sends rank ``owner`` its part of the save ``(step,
    attempt)`` from the peer folder it keeps of ``owner`` (a write-back at
    resume). A folder or record that cannot be read sends a "nothing" frame
    (the receiver then does not hold the save); a component that fails to
    read is sent as zeros (the receiver's digest refuses it). Returns what failed."""
    try:
        backend = open_tier_dir(local_tier, owner, create=False, folder=peer_folder(holder, owner))
        if backend is None:
            raise PeerCopyError(f"rank {holder} holds no peer folder of rank {owner}")
    except CkptStoreError as exc:
        send_part(link, dst, step, None, lambda n, e: iter(()), [])
        return [str(exc)[:300]]
    try:
        io = RunIO(backend, run_id, None)
        read_run_record(io, None)  # the folder's copy of the run record: the layout of its names
        rec = Catalog(io, AttemptLog(io, auth), identity_digest).load_commit(step, attempt)
        data = rec.encode()
    except (CkptStoreError, OSError) as exc:
        backend.close()
        send_part(link, dst, step, None, lambda n, e: iter(()), [])
        return [f"{type(exc).__name__}: {exc}"[:300]]
    try:
        mine = part_names(rec, owner)
        names = sorted(mine if mine is not None else rec.components)
        return send_part(link, dst, step, data, lambda n, e: io.verified_chunks(
            component_key(run_id, rec.save_id, n), e, f"rank {holder}'s peer copy of {n!r}"), names)
    finally:
        backend.close()


def write_back(frame: Frame, local_tier: str | os.PathLike[str], rank: int, url: str | os.PathLike[str],
               storage_options: Mapping[str, Any] | None, auth: RecordAuth, identity_digest: str,
               retry: RetryPolicy | None) -> SaveRef:
    """Rank ``rank`` writes its own part, received from a holder of its peer
    copy, back into its own folder (``<local_tier>/rank-<r>``): the durable
    run record and attempt records (of the durable store at ``url``) mirrored
    there first (never the holder's copies), then :func:`receive_part`. The
    frame is consumed whole, whatever fails."""
    try:
        backend = backend_from_url(url, storage_options=storage_options)
    except BaseException:
        frame.drain()
        raise
    try:
        return _write_back(frame, local_tier, rank, RunIO(backend, frame.record.run_id, retry), auth,
                           identity_digest, retry)
    finally:
        backend.close()


def _same_as_durable(durable: RunIO, attempts: AttemptLog, identity_digest: str, rec: CommitRecord) -> None:
    """A copy of a save the durable tier also holds must be that save's record (same manifest digest): a
    copy that differs is refused before anything of it is written (a missing durable commit is not a
    refusal: the save may never have been replicated; an unreadable one is, fail closed)."""
    try:
        durable_rec = Catalog(durable, attempts, identity_digest).load_commit(rec.step, rec.attempt)
    except NotFoundError:
        return
    if durable_rec.manifest_digest() != rec.manifest_digest():
        raise CorruptionError(f"the peer copy of step {rec.step} (attempt {rec.attempt}) differs from the durable "
                              "commit of the same step and attempt; it is not written back")


def _write_back(frame: Frame, local_tier: str | os.PathLike[str], rank: int, durable: RunIO, auth: RecordAuth,
                identity_digest: str, retry: RetryPolicy | None) -> SaveRef:
    try:
        attempts = AttemptLog(durable, auth)
        tier = LocalTier(local_tier, durable.run_id, attempts, identity_digest, auth, retry, part=rank,
                         durable_url=durable.backend.url)
    except BaseException:
        frame.drain()
        raise
    try:
        run_record, _ = read_durable_records(durable, frame.record.attempt)
        read_run_record(durable, None)
        _same_as_durable(durable, attempts, identity_digest, frame.record)
        tier.io.layout_or_none = durable.layout  # the durable run record decides the naming
        tier.mirror(run_record, attempts.load())
        return receive_part(frame, tier)
    except BaseException:
        frame.drain()
        raise
    finally:
        tier.backend.close()
