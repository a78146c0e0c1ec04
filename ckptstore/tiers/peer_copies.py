"""Peer copies: each rank's local part of a save also held by ``k`` ranks on
other nodes (``docs/tiers.md`` "Peer copies", PROTOCOL.md §4.8 item 8, THREATS.md §4.16).

This module is who holds whom and the background copy thread; the frames are
:mod:`.peer_frames`, the resume's plan and write-back :mod:`.peer_repair`. It
imports no torch. The transport is a :class:`PeerLink` (two calls: send bytes to a rank, receive
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
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.bounded_io import RunIO
from ..core.catalog import part_names
from ..core.fencing import AttemptLog
from ..core.piece_evidence import PieceEvidence
from ..core.record_auth import RecordAuth
from ..errors import CkptStoreError, InvalidInputError
from ..protocol import ComponentEntry
from ..protocol.selection import SaveRef
from ..retry import RetryPolicy
from .local import LocalTier
from .peer_frames import FrameObject, PeerCopyError, PeerLink, receive_frame, receive_part, send_part
from .replicator import PeerStatus
from .tier_dir import peer_folder

__all__ = ["MAX_WAITING", "PEER_WAIT_SECONDS", "HeldPieces", "PeerCopies", "assign_receivers", "copy_pairs",
           "node_name", "open_peer_folder"]

#: acknowledged saves waiting for the copy thread at most; beyond it the oldest are skipped (newest wins)
MAX_WAITING = 2
#: how long a save waits for its peer copies when the job does not say (``open_distributed`` says: its timeout)
PEER_WAIT_SECONDS = 60.0


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
    blocking the caller. ``read(key, entry)`` streams an object (a component
    or a piece) of this rank's own local tier, verified; ``folder(sender)``
    opens the peer folder this rank keeps of ``sender``'s parts (its records
    mirrored); ``record`` writes a ledger event (best effort)."""

    def __init__(self, link: PeerLink, receivers: Mapping[int, Sequence[int]], *, run_id: str,
                 read: Callable[[str, ComponentEntry], Iterator[bytes]],
                 folder: Callable[[int], LocalTier], keep: int,
                 record: Callable[[str, Mapping[str, Any]], None]) -> None:
        self.link, self.rank, self.run_id = link, link.rank, run_id
        self.pairs = copy_pairs(receivers)
        self._read, self._folder, self.keep, self._record = read, folder, keep, record
        self._status = {("sends-to", h): _Pair(h, "sends-to") for s, h in self.pairs if s == self.rank}
        self._status |= {("receives-from", s): _Pair(s, "receives-from") for s, h in self.pairs if h == self.rank}
        self._tiers: dict[int, LocalTier] = {}
        #: per sender, the pieces this rank holds of its parts (version 3: not asked for again)
        self._held: dict[int, HeldPieces] = {}
        self._queue: queue.Queue[SaveRef | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._submitted = self._handled = 0  # saves submitted / handled so far (the queue is FIFO)
        self._outcome: dict[int, str] = {}  # ticket -> "landed", "failed" or "stopped" (the newest few)
        self.stopped: str | None = None
        self._thread = threading.Thread(target=self._run, name="ckptstore-peers", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        """Whether this rank takes part in any copy pair."""
        return bool(self._status)

    def submit(self, ref: SaveRef) -> int:
        """``ref`` was acknowledged on every rank: copy its parts (in the background). Returns its
        ticket for :meth:`wait`."""
        with self._lock:
            self._busy += 1
            self._submitted += 1
            ticket = self._submitted
        self._queue.put(ref)
        return ticket

    def wait(self, ticket: int, timeout: float) -> str:
        """Wait until the save of ``ticket`` was handled: ``"landed"`` (every copy of this rank's
        pairs sent and committed by its receiver), ``"failed"`` (skipped or refused, or copies had
        stopped before: see :meth:`status` and the ledger), ``"stopped"`` (the link failed during this
        save's copies: a peer gone or out of step; the copies stop), or ``"late"`` when ``timeout``
        seconds passed first (the copy goes on)."""
        end = time.monotonic() + timeout
        with self._idle:
            while self._handled < ticket:
                left = end - time.monotonic()
                if left <= 0:
                    return "late"
                self._idle.wait(left)
            return self._outcome.get(ticket, "failed")

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
    def _done(self, outcome: str) -> None:
        with self._idle:
            self._busy -= 1
            self._handled += 1
            self._outcome[self._handled] = outcome
            self._outcome.pop(self._handled - 64, None)
            self._idle.notify_all()

    def _run(self) -> None:
        while True:
            ref = self._queue.get()
            if ref is None:
                return
            behind = self._queue.qsize() >= MAX_WAITING  # newer saves wait: this one's turn is "nothing new"
            outcome = "failed"
            try:
                if self.stopped is None and self.active:
                    outcome = "landed" if self._round(ref, send=not behind) else "failed"
            except BaseException as exc:  # noqa: BLE001 - the link is out of step: stop copying, say so
                self._stop(f"{type(exc).__name__}: {exc}"[:500], ref)
                outcome = "stopped"
            finally:
                self._done(outcome)

    def _stop(self, why: str, ref: SaveRef) -> None:
        with self._lock:
            self.stopped = why
            for p in self._status.values():
                p.last_error = why
                p.failures += 1
        with contextlib.suppress(Exception):
            self._record("peer-copy-stopped", {"rank": self.rank, "step": ref.step, "why": why})

    def _round(self, ref: SaveRef, *, send: bool) -> bool:
        """One save's copies, pair by pair; whether every one of this rank's pairs landed."""
        landed = True
        rec_bytes = ref.record.encode()
        mine = part_names(ref.record, self.rank)
        for s, h in self.pairs:
            if s == self.rank:
                p = self._status[("sends-to", h)]
                names = sorted(mine if mine is not None else ref.record.components)
                if not send:
                    send_part(self.link, h, ref.step, None, self._read, names)
                    with self._lock:
                        p.skipped += 1
                    landed = False
                    continue
                sent = send_part(self.link, h, ref.step, rec_bytes, self._read, names)
                why = (f"own copy unreadable, sent as zeros: {sent.failed[0]}" if sent.failed else
                       f"rank {h} refused the copy (its ledger says why)" if sent.refused else None)
                with self._lock:
                    p.last_step = ref.step
                    p.copies += 1
                    p.nbytes += sent.nbytes
                    if why is not None:
                        p.failures += 1
                        p.last_error = why[:500]
                if why is not None:
                    landed = False
                    if sent.failed:
                        with contextlib.suppress(Exception):
                            self._record("peer-copy-failed", {"rank": self.rank, "to": h, "step": ref.step,
                                                              "why": why[:500]})
            elif h == self.rank:
                landed = self._receive(s, ref, rec_bytes) and landed
        return landed

    def _receive(self, sender: int, ref: SaveRef, expect: bytes) -> bool:
        """Receive ``sender``'s part of ``ref`` into its folder; whether it landed."""
        p = self._status[("receives-from", sender)]
        frame = receive_frame(self.link, sender, sender, self.run_id)
        if frame is None:
            with self._lock:
                p.skipped += 1
            return False
        if frame.data != expect:
            frame.drain()
            with self._lock:
                p.failures += 1
                p.last_error = f"step {frame.step}: the record sent is not the save acknowledged here; not kept"
            return False
        held = self._held.get(sender)
        asked: list[bool] = []
        try:
            tier = self._tiers.get(sender)
            if tier is None:
                try:
                    tier = self._tiers[sender] = self._folder(sender)
                except BaseException:
                    frame.drain()  # the frame stays in step whatever happened here
                    raise
            if held is None:
                held = self._held[sender] = HeldPieces(tier.io)

            def need(objects: Sequence[FrameObject]) -> list[bool]:
                asked[:] = held.need(objects)
                return asked

            receive_part(frame, tier, need)
            if frame.pieced:
                held.landed(frame.objects, asked)
            tier.gc(keep_last=self.keep)
        except PeerCopyError:
            raise  # the link itself failed (a peer gone, a deadline): out of step, the copies stop
        except (CkptStoreError, OSError) as exc:
            if held is not None:
                held.forget()  # the next copy asks for every piece again
            why = f"step {ref.step}: {type(exc).__name__}: {exc}"[:500]
            with self._lock:
                p.failures += 1
                p.last_error = why
            with contextlib.suppress(Exception):
                self._record("peer-copy-failed", {"rank": self.rank, "from": sender, "step": ref.step, "why": why})
            return False
        got = sum(o.entry.size for o, n in zip(frame.objects, asked, strict=True) if n) if asked else \
            sum(o.entry.size for o in frame.objects)
        with self._lock:
            p.last_step = ref.step
            p.copies += 1
            p.nbytes += got
        return True


class HeldPieces:
    """What a holder knows of the pieces in one peer folder (version 3): those
    of the newest copy it landed there in this process, which the next copy
    does not ask for while their evidence holds (§9.2 "Evidence", the one rule:
    :class:`~ckptstore.core.piece_evidence.PieceEvidence`). A piece with no
    evidence, a changed listing, or due for its periodic re-hash is re-hashed
    here first; one missing, of another size or damaged is asked for again.
    After a restart nothing is known: the first copy carries every piece."""

    def __init__(self, io: RunIO) -> None:
        #: (holder, digest) -> size of the pieces of the newest copy landed
        self.known: dict[tuple[str, str], int] = {}
        self.evidence = PieceEvidence(io)

    def need(self, objects: Sequence[FrameObject]) -> list[bool]:
        """For each object of a frame, whether the sender is to send it."""
        self.evidence.begin()
        reuse = {o.piece: o.entry.size for o in objects
                 if o.piece is not None and self.known.get(o.piece) == o.entry.size}
        suspect, dropped = self.evidence.triage(reuse)
        intact = {hd for hd, size in reuse.items() if hd not in dropped
                  and (hd not in suspect or self.evidence.recheck(hd, size, suspect[hd]) is None)}
        return [o.piece is None or o.piece not in intact for o in objects]

    def landed(self, objects: Sequence[FrameObject], sent: Sequence[bool]) -> None:
        """A copy of ``objects`` landed, those of ``sent`` written (and hashed) just now."""
        names = {o.piece: o.entry.size for o in objects if o.piece is not None}
        fresh = {o.piece for o, s in zip(objects, sent, strict=True) if s and o.piece is not None}
        self.known = names
        self.evidence.retain(names, fresh)
        with contextlib.suppress(CkptStoreError, OSError):  # no evidence: re-hashed before the next reuse
            self.evidence.take({hd: names[hd] for hd in fresh})

    def forget(self) -> None:
        self.known = {}


def open_peer_folder(local_tier: str | os.PathLike[str], holder: int, sender: int, run_id: str,
                     durable_attempts: AttemptLog, identity_digest: str, auth: RecordAuth,
                     retry: RetryPolicy | None, durable_url: str) -> LocalTier:
    """The peer folder rank ``holder`` keeps of rank ``sender``'s parts, as a
    tier holding ``sender``'s part (created, without following links)."""
    return LocalTier(local_tier, run_id, durable_attempts, identity_digest, auth, retry, part=sender,
                     durable_url=durable_url, folder=peer_folder(holder, sender))
