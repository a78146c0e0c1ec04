"""Pieces addressed by content, written (PROTOCOL.md §9): one writer's view
of the run's pieces (:class:`PieceWriter`: what it knows, its save intent,
its anchor, what it learned of what changes) and one save's pieces side
(:class:`SavePieces`: a component written as pieces that skip what the run
already holds, and the checks before its commit).

Beside it: the intents and the timing (:mod:`.intents`), the deadlines a
coordinator checks (:mod:`.piece_deadlines`), checking and reading pieced
components (:mod:`.piece_reads`), the evidence a known piece is intact
(:mod:`.piece_evidence`). The cut points and the sweep rule are pure
(:mod:`ckptstore.protocol.pieces`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import blake3

from ..backends.base import PendingPut
from ..errors import CkptStoreError, NotFoundError, SaveAbortedError
from ..protocol import CommitRecord, ComponentEntry, parse_save_id
from ..protocol.layout import (
    STEP_WIDTH,
    new_intent_key,
    parse_piece_key,
    piece_key,
    pieces_prefix,
)
from ..protocol.pieces import cut_planned
from ..protocol.records import IntentRecord, PieceRef, pieces_digest
from .bounded_io import RunIO
from .hashing import iter_chunks
from .intents import RENEW_SHARE, Intent, PieceTiming
from .piece_deadlines import PieceDeadline, Publication
from .piece_evidence import Evidence, PieceEvidence
from .piece_reads import check_present

#: Pieces uploaded at the same time by one ``put``.
UPLOAD_CONCURRENCY = 4
#: Pieces written before their fsyncs are issued together (``Backend.settle``).
SETTLE_BATCH = 32
#: Damage reports a writer keeps (``PieceWriter.damaged``), newest last.
DAMAGE_REPORTS = 100
#: Every this many saves a writer cuts every buffer alone again (*probes*, §9.2 "Packing what
#: changes"), so that a buffer packed as changing that stopped changing is found again: two saves
#: in a row (the first gives every buffer a piece of its own again, the second learns from it).
PROBE_EVERY = 16


class DamagedPieceWarning(UserWarning):
    """A known piece failed its evidence check (§9.2 "Evidence"): it changed,
    shrank or vanished since it was learned. The save it was found by wrote
    the piece again under its own ID and is restorable; the old copy is left
    for gc (no commit the writer makes names it again)."""



class PieceWriter:
    """One writer's view of the run's pieces: the pieces of the newest commit
    it knows (in memory, never listed per piece) and the save intent naming
    them. Shared by the saves of one store."""

    def __init__(self, io: RunIO, attempt: int, timing: PieceTiming) -> None:
        self.io = io
        self.attempt = attempt
        self.timing = timing
        self._lock = threading.Lock()
        self.known: dict[str, PieceRef] = {}
        self.intent: Intent | None = None
        self._saves: dict[str, SavePieces] = {}
        #: the intent write :meth:`learn` started in the background (joined before any other use of the intent)
        self._arming: threading.Thread | None = None
        #: guards :attr:`_arming`: a thread is published only once started (another save's ``begin`` joins it)
        self._arming_lock = threading.Lock()
        #: what this writer knows of the pieces it wrote or re-hashed (§9.2 "Evidence"; its ``uses``
        #: are the saves begun, its ``rehashed`` the pieces read again)
        self.evidence = PieceEvidence(io)
        #: what the evidence checks found (one line per piece, newest last, at most DAMAGE_REPORTS)
        self.damaged: list[str] = []
        #: per component, what the last informed probe save saw (§9.2 "Packing what changes"): the
        #: sizes of its buffers and the indices of those it wrote anew (changed since the save before)
        self.changing: dict[str, tuple[tuple[int, ...], frozenset[int]]] = {}
        #: saves committed since that probe (the next save probes at PROBE_EVERY - 1)
        self.since_probe = 0
        #: whether the known pieces are of a save that cut every buffer alone (this writer's probe):
        #: only then does a probe's "written anew" mean "changed" (a packed buffer has no piece of its own)
        self.known_cut_alone = False
        #: §9.4 "The anchor": the pieces of the newest commit this writer published, while it is the
        #: newest commit of the run that is not superseded (empty: none). A save begun under it may rely
        #: on them without waiting for the window, when no commit of this writer started since
        self.anchor: frozenset[tuple[str, str]] = frozenset()
        #: :attr:`commits_started` when the anchor was learned (-1: no anchor)
        self.anchor_epoch = -1
        #: (step, attempt) of the anchor's commit (None: no anchor)
        self.anchor_key: tuple[int, int] | None = None
        #: commits this writer started creating (:meth:`publishing`)
        self.commits_started = 0
        #: the newest (step, attempt) this writer learned not from its own publication (its resume point):
        #: a commit of its own is an anchor only above it
        self._floor: tuple[int, int] | None = None
        #: the newest (step, attempt) this writer published
        self._newest_own: tuple[int, int] | None = None
        #: held from a save's check before publishing until its commit returned (:meth:`publishing`)
        self._publish_lock = threading.Lock()

    def active(self, save_id: str) -> SavePieces | None:
        """The pieces side of a save this writer staged and has not published."""
        with self._lock:
            return self._saves.get(save_id)

    def learn(self, rec: CommitRecord | None, verified: bool = False) -> None:
        """Take the pieces of ``rec`` (the newest commit) as the ones saves may
        skip, and start writing the intent naming them now, in the background
        (off the save that just committed), so that the next save finds it
        already old enough to rely on. :meth:`begin` and :meth:`close` wait for
        that write first; if it failed, :meth:`begin` writes the intent itself.

        Evidence (§9.2): the pieces this process wrote for ``rec`` — or, with
        ``verified`` (the caller hashed every piece of ``rec`` just now, e.g. a
        deep resume), all of them — count as checked now, and their listing,
        taken in the same background step, is their evidence; any other piece
        is re-hashed before its first reuse."""
        known: dict[str, PieceRef] = {}
        if rec is not None:
            for c in rec.components.values():
                for p in c.pieces or ():
                    known.setdefault(p.digest, p)
        names = frozenset((p.holder, p.digest) for p in known.values())
        with self._lock:
            self.known = known
            own = self._saves.pop(rec.save_id, None) if rec is not None else None
            if own is not None and own.probe:
                # what changed is known only against pieces of a save cut alone: after a run's first
                # save, a restart, or packed saves, the first probe teaches nothing and the next one does
                self.changing = dict(own.seen) if own.informed else {}
                self.since_probe = 0
            elif own is not None:
                self.since_probe += 1
            else:  # another process's commit (a resume point): probe before packing anything
                self.changing, self.since_probe = {}, 0
            self.known_cut_alone = own is not None and own.probe
            self._learn_anchor(rec, own is not None, names)
            # evidence is kept only for pieces still known; the pieces this process just wrote are
            # intact as of now (hashed while written): their evidence is the listing made below
            fresh = {(own.save_id, d) for d in own.written} & names if own is not None else set()
            if verified:
                fresh = set(names)
            self.evidence.retain(names, fresh)
            sizes = {(p.holder, p.digest): p.size for p in known.values()}

        def arm() -> None:
            try:
                self._arm(names)
            except CkptStoreError:
                pass  # the save is published; the next save writes its intent before relying on these pieces
            if fresh:
                try:
                    self.evidence.take({hd: sizes[hd] for hd in fresh})
                except CkptStoreError:
                    pass  # no evidence: the next save re-hashes these pieces before reusing them

        with self._arming_lock:  # the previous write first (one intent at a time), then this one, started
            prev = self._arming
            if prev is not None:
                prev.join()
            t = threading.Thread(target=arm, name="ckptstore-intent", daemon=True)
            t.start()
            self._arming = t

    def _learn_anchor(self, rec: CommitRecord | None, own: bool, names: frozenset[tuple[str, str]]) -> None:
        """§9.4 "The anchor" (under ``self._lock``): ``rec`` becomes the anchor when this writer
        published it (``own``), of its own attempt, above its resume point and above every commit
        it published before (so no commit that is not superseded is newer: saves of earlier
        attempts above the resume point are superseded by this attempt). Anything else: no anchor."""
        self.anchor, self.anchor_epoch, self.anchor_key = frozenset(), -1, None
        if rec is None:
            return
        key = (rec.step, rec.attempt)
        if not own:
            self._floor = key if self._floor is None else max(self._floor, key)
            return
        newest = self._newest_own
        self._newest_own = key if newest is None else max(newest, key)
        if rec.attempt == self.attempt and (self._floor is None or key > self._floor) \
                and (newest is None or key > newest):
            self.anchor, self.anchor_epoch, self.anchor_key = names, self.commits_started, key

    @contextlib.contextmanager
    def publishing(self, save: SavePieces | None) -> Iterator[Publication]:
        """Around one publication of this writer, from its checks (§9.4) until its commit
        record was created or failed: one at a time. Yields whether ``save`` may rely on
        its anchor (:attr:`SavePieces.anchor`): it began under the anchor this writer
        still holds, and no commit of this writer started since (a newer commit would let
        a gc delete the anchor's commit and sweep what only it names); and that anchor's
        (step, attempt) while it holds (what other ranks' parts may have relied on).
        Counts the commit as started on entry, so every save begun before it relies on
        its intent from then on."""
        with self._publish_lock:
            with self._lock:
                holds = self.anchor_epoch >= 0 and self.anchor_epoch == self.commits_started
                ok = holds and save is not None and save.anchor_epoch == self.anchor_epoch
                pub = Publication(ok, self.anchor_key if holds else None)
                self.commits_started += 1
            yield pub

    def _report(self, line: str) -> None:
        with self._lock:
            self.damaged.append(line)
            del self.damaged[:-DAMAGE_REPORTS]
        warnings.warn(line, DamagedPieceWarning, stacklevel=4)

    def _still_intact(self, known: dict[str, PieceRef]
                      ) -> tuple[dict[str, PieceRef], dict[tuple[str, str], Evidence]]:
        """§9.2 "Evidence" (:class:`~ckptstore.core.piece_evidence.PieceEvidence`, the one
        rule): the known pieces whose listing still holds, and those of them to
        re-hash before their first reuse by this save (with the listing's
        evidence), which happens when the save is about to reuse one
        (:meth:`SavePieces._reuse`), not before: a piece the save writes anew
        (it changed) is never read. A piece missing or of another size is
        dropped and written again by the save (under its own ID); what was
        found is reported."""
        suspect, dropped = self.evidence.triage({(p.holder, p.digest): p.size for p in known.values()})
        for why in dropped.values():
            if why:
                self._report(f"{why}: written again under this save")
        out = {d: p for d, p in known.items() if (p.holder, p.digest) not in dropped}
        if len(out) < len(known):
            self._forget(set(known) - set(out))
        return out, suspect

    def _forget(self, digests: set[str]) -> None:
        """Later saves do not reuse these known pieces either (they failed their evidence)."""
        with self._lock:
            self.known = {d: p for d, p in self.known.items() if d not in digests}

    def _recheck(self, p: PieceRef, listed: Evidence) -> bool:
        """Re-hash a known piece before its reuse (§9.2 "Evidence"): True when
        it still matches its digest (its listing is then its evidence again)."""
        why = self.evidence.recheck((p.holder, p.digest), p.size, listed)
        if why is None:
            return True
        if why:
            self._report(f"{why}: written again under this save")
        self._forget({p.digest})
        return False

    def settle(self) -> None:
        """Wait until the intent :meth:`learn` started writing landed and the
        previous one was removed (a gc in this process then sees this writer's
        one intent, not the one its last commit made stale)."""
        self._settle_arming()

    def _settle_arming(self) -> None:
        """Wait for the intent write :meth:`learn` started, if any."""
        with self._arming_lock:  # joined under the lock: no other intent write starts meanwhile
            t, self._arming = self._arming, None
            if t is not None:
                t.join()

    def _arm(self, names: frozenset[tuple[str, str]]) -> Intent | None:
        """Write an intent naming ``names`` (none when empty), then remove the previous one."""
        old = self.intent
        if not names:
            self.intent = None
        else:
            t = self.timing.clock()
            rec = IntentRecord(self.io.run_id, self.attempt, t, t + self.timing.intent_ttl, tuple(sorted(names)),
                               version=self.io.layout.version)
            key = new_intent_key(self.io.run_id, self.attempt)
            # lazy: an intent is for a gc running while this writer lives, which sees it on return;
            # a crash that loses its name ends this writer too (PROTOCOL.md §7.2)
            self.io.create(key, rec.encode(), what="save intent", lazy=True)
            self.intent = Intent(key, rec, time.monotonic())
        if old is not None:
            try:
                self.io.delete(old.key, lazy=True)
            except Exception:  # noqa: BLE001 - best effort: an old intent only keeps pieces a while longer
                pass
        return self.intent

    def begin(self, step: int, save_id: str) -> SavePieces:
        """The pieces context of one save of ``step``: the known pieces, plus
        those an earlier, uncommitted save of the same step left (a resumed
        failed save reuses them once they verify); the intent is renewed when
        it does not name them all or is half way through its life."""
        self._settle_arming()
        self.evidence.begin()
        with self._lock:
            known = dict(self.known)
            probe = not self.changing or self.since_probe >= PROBE_EVERY - 1
            plan = {} if probe else dict(self.changing)
            informed = bool(known) and self.known_cut_alone
            anchor, anchor_epoch, anchor_key = self.anchor, self.anchor_epoch, self.anchor_key
        left = self._left_by_step(step, save_id, {p.holder for p in known.values()})
        names = frozenset((p.holder, p.digest) for p in known.values()) | frozenset(left)
        intent = self.intent
        stale = (intent is not None
                 and self.timing.clock() > intent.record.created_at + RENEW_SHARE * self.timing.intent_ttl)
        if names and (intent is None or not names <= intent.names or stale):
            intent = self._arm(names)
        suspect: dict[tuple[str, str], tuple[int, float, str]] = {}
        if known:
            # after the intent: an old one may have lapsed and gc swept what it named; and a piece is
            # reused only while the evidence that it is intact holds (§9.2 "Evidence")
            known, suspect = self._still_intact(known)
        save = SavePieces(self, save_id, known, left, intent, probe=probe, informed=informed, plan=plan,
                          suspect=suspect, anchor=anchor, anchor_epoch=anchor_epoch, anchor_key=anchor_key)
        with self._lock:
            self._saves[save_id] = save
        return save

    def _left_by_step(self, step: int, save_id: str, skip: set[str]) -> dict[tuple[str, str], int]:
        """Pieces under holders of ``step`` of *earlier* attempts (a failed or killed
        attempt's save of the same step). A holder of this writer's own attempt is a
        save of this job that may still be running, or that lost a commit race and
        removes its pieces (``core.writer``): never relied on."""
        prefix = pieces_prefix(self.io.run_id) + f"{step:0{STEP_WIDTH}d}-"
        out: dict[tuple[str, str], int] = {}
        for o in self.io.list(prefix):
            hd = parse_piece_key(self.io.run_id, o.key)
            sa = parse_save_id(hd[0]) if hd is not None else None
            if hd is not None and sa is not None and sa[1] < self.attempt and hd[0] != save_id and hd[0] not in skip:
                out[hd] = o.size
        return out

    def close(self) -> None:
        """Remove the intent (best effort: an intent left behind expires)."""
        self._settle_arming()
        if self.intent is not None:
            try:
                self.io.delete(self.intent.key, lazy=True)
            except Exception:  # noqa: BLE001 - it expires on its own
                pass
            self.intent = None


@dataclass
class SavePieces:
    """The pieces side of one save: what it may skip, what it wrote."""

    owner: PieceWriter
    save_id: str
    known: dict[str, PieceRef]
    #: (holder, digest) -> size of pieces a failed save of the same step left (not yet verified)
    left: dict[tuple[str, str], int]
    intent: Intent | None
    started: float = field(default_factory=time.monotonic)
    written: dict[str, PieceRef] = field(default_factory=dict)
    reused_bytes: int = 0
    written_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _recheck_lock: threading.Lock = field(default_factory=threading.Lock)
    _left_by_digest: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: pieces of other saves this save relies on (its intent must name them)
    relied: set[tuple[str, str]] = field(default_factory=set)
    #: a probe cuts every buffer alone (§9.2 "Packing what changes"); ``informed``: pieces of an
    #: earlier save were known, so a buffer written anew is one that changed
    probe: bool = True
    informed: bool = False
    #: per component, the probe's view this save packs by (empty for a probe)
    plan: dict[str, tuple[tuple[int, ...], frozenset[int]]] = field(default_factory=dict)
    #: per component, what this save saw (a probe's lesson, taken by ``PieceWriter.learn``)
    seen: dict[str, tuple[tuple[int, ...], frozenset[int]]] = field(default_factory=dict)
    #: known pieces to re-hash before this save first reuses them, with their listing (§9.2 "Evidence")
    suspect: dict[tuple[str, str], tuple[int, float, str]] = field(default_factory=dict)
    #: the writer's anchor when this save began, its epoch (-1: none) and (step, attempt) (§9.4 "The anchor")
    anchor: frozenset[tuple[str, str]] = frozenset()
    anchor_epoch: int = -1
    anchor_key: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for (holder, digest), size in self.left.items():
            self._left_by_digest.setdefault(digest, (holder, size))

    def _reuse(self, digest: str, size: int) -> PieceRef | None:
        with self._lock:
            hit = self.known.get(digest) or self.written.get(digest)
            due = hit is not None and (hit.holder, hit.digest) in self.suspect
        if hit is not None and hit.size == size:
            if due:
                # re-hashed once, before any component of this save relies on it; a second
                # component reusing the same piece waits for that check's verdict
                with self._recheck_lock:
                    with self._lock:
                        listed = self.suspect.get((hit.holder, hit.digest))
                    ok = listed is None or self.owner._recheck(hit, listed)
                    with self._lock:
                        self.suspect.pop((hit.holder, hit.digest), None)
                        if not ok:
                            self.known.pop(digest, None)
                        intact = self.known.get(digest) is hit
                if not intact:
                    return None
            return hit
        left = self._left_by_digest.get(digest)
        if left is not None and left[1] == size:
            key = piece_key(self.owner.io.run_id, left[0], digest)
            try:
                seen, got = self.owner.io.hash_object(key, size)
            except NotFoundError:
                return None
            if seen == size and got == digest:  # it verifies: reuse it, as every later save will
                ref = PieceRef(left[0], digest, size)
                with self._lock:
                    self.known[digest] = ref
                return ref
        return None

    def put(self, name: str, data: Any, *, defer: list[PendingPut] | None = None) -> ComponentEntry:
        """Write one component as pieces: each piece hashed, skipped when the
        run already holds it, else uploaded under this save. Its new pieces
        are settled (durable) before this returns; with ``defer``, the last
        batch of them is appended to ``defer`` instead, and the caller MUST
        settle it before the entry is used (``StagedSave.put_many`` settles
        the pieces of all its components together)."""
        io = self.owner.io
        refs: list[PieceRef] = []
        pending: list[Future[PendingPut]] = []
        landed: list[PendingPut] = []
        pool = ThreadPoolExecutor(UPLOAD_CONCURRENCY, thread_name_prefix="ckptstore-piece")
        expected, changing = self.plan.get(name, ((), frozenset()))
        live = set(changing)  # packed as changing while the buffers have the probe's sizes
        sizes: list[int] = []
        anew: set[int] = set()

        def buffers() -> Iterator[memoryview]:
            for i, b in enumerate(iter_chunks(data, None)):
                if live and (i >= len(expected) or len(b) != expected[i]):
                    live.clear()  # another layout than the probe's: every buffer from here on cut alone
                sizes.append(len(b))
                yield b

        try:
            for piece, held in cut_planned(buffers(), live):
                size = sum(len(v) for v in piece)
                h = blake3.blake3(max_threads=blake3.blake3.AUTO if size >= 1 << 22 else 1)
                for v in piece:
                    h.update(v)
                digest = h.hexdigest()
                ref = self._reuse(digest, size)
                if ref is None or ref.holder == self.save_id:
                    anew |= held
                if ref is not None and ref.holder != self.save_id:
                    with self._lock:
                        self.relied.add((ref.holder, ref.digest))
                if ref is None:
                    ref = PieceRef(self.save_id, digest, size)
                    with self._lock:
                        first = digest not in self.written
                        self.written.setdefault(digest, ref)
                    if first:
                        key = piece_key(io.run_id, self.save_id, digest)
                        pending.append(pool.submit(io.retry.call, partial(io.backend.put_deferred, key, piece)))
                        self.written_bytes += size
                        while len(pending) >= 2 * UPLOAD_CONCURRENCY:
                            landed.append(pending.pop(0).result())
                        if len(landed) >= SETTLE_BATCH:
                            io.backend.settle(landed)
                            landed = []
                else:
                    self.reused_bytes += size
                refs.append(ref)
            while pending:
                landed.append(pending.pop(0).result())
            if self.probe and self.informed:
                with self._lock:
                    self.seen[name] = (tuple(sizes), frozenset(anew))
            if defer is not None:
                defer.extend(landed)  # the caller settles them before the entry is used
            else:
                io.backend.settle(landed)  # every piece of the component durable before put returns
            landed = []
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for f in pending:  # a failed put: what landed is settled (closed) anyway, best effort
                if f.done() and not f.cancelled() and f.exception() is None:
                    landed.append(f.result())
            if landed:
                try:
                    io.backend.settle(landed)
                except Exception:  # noqa: BLE001 - the put failed already; its error is the one raised
                    pass
        return ComponentEntry(name, sum(p.size for p in refs), pieces_digest(refs), tuple(refs))

    def check_relied(self, *, anchored: bool = False, claim: bool = False) -> PieceDeadline:
        """§9.4 steps 1-2, for this process's part of the save: it ran
        shorter than its intent's lifetime less the window; every piece of
        another save it relies on is named by its intent, which is at least
        ``window`` old (waited for when needed) and not near expiry — except,
        with ``anchored`` (from :meth:`PieceWriter.publishing`, the commit made
        by this process), the pieces its anchor names, which need neither.
        ``claim``: a rank's part that another process commits — when its save
        began under the anchor it still holds and it relies on nothing else, it
        does not wait: the deadline names the anchor, for the coordinator to
        check at its commit (:func:`check_rank_anchors`). Returns the deadlines
        a coordinator re-checks at its publish (a rank's part,
        :func:`check_deadlines`). Otherwise :class:`SaveAbortedError`."""
        timing = self.owner.timing
        elapsed = time.monotonic() - self.started
        if elapsed > timing.intent_ttl - timing.window:
            raise SaveAbortedError(
                f"save {self.save_id} took longer than its pieces are protected ({timing.intent_ttl:.0f}s less the "
                f"{timing.window:.0f}s window); nothing was published"
            )
        deadline = PieceDeadline(started_at=timing.clock() - elapsed, intent_expires_at=None)
        with self._lock:
            reused = set(self.relied)  # other processes' (ranks') reuse is under their own intents
        if anchored:
            reused -= self.anchor  # kept by every gc while this save publishes (§9.4 "The anchor")
        elif claim and reused and reused <= self.anchor and self.anchor_key is not None \
                and self.anchor_key == self.owner.anchor_key:
            intent = self.intent
            landed = None if intent is None else timing.clock() - (time.monotonic() - intent.landed)
            return PieceDeadline(deadline.started_at, None if intent is None else intent.record.expires_at,
                                 anchor=self.anchor_key, intent_landed_at=landed)
        if reused:
            intent = self.intent
            if intent is None or not reused <= intent.names:
                raise SaveAbortedError(f"save {self.save_id} relies on pieces no save intent names; nothing was published")
            wait = intent.landed + timing.window - time.monotonic()
            if wait > 0:
                timing.sleep(wait)
            if timing.clock() > intent.record.expires_at - timing.window:
                raise SaveAbortedError(f"save {self.save_id}: its save intent expired; nothing was published")
            deadline = PieceDeadline(deadline.started_at, intent.record.expires_at)
        return deadline

    def check_before_publish(self, components: Mapping[str, ComponentEntry], *, anchored: bool = False) -> None:
        """§9.4 at publish: :meth:`check_relied` (``anchored``: see there), then
        every piece the save names is there with its size. Otherwise
        :class:`SaveAbortedError` (nothing published)."""
        self.check_relied(anchored=anchored)
        check_present(self.owner.io, components, self.save_id)

    def abort(self) -> None:
        """Remove the pieces this save wrote (best effort; gc removes leftovers)."""
        io = self.owner.io
        with self._lock:
            mine = list(self.written)
        for digest in mine:
            try:
                io.backend.delete(piece_key(io.run_id, self.save_id, digest))
            except Exception:  # noqa: BLE001 - best effort
                pass
