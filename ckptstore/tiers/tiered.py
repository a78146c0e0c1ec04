"""The two tiers of one store together: what :class:`~ckptstore.CheckpointStore`
delegates to (its placement) when opened with ``OpenOptions(tiers=...)`` (PROTOCOL.md §"Tiers",
``docs/tiers.md``).

* save: stage and publish in the local tier (local-disk speed), then queue the
  save for the :class:`~ckptstore.tiers.replicator.Replicator`;
* select / resume: the newest save complete in either tier, a local copy only
  when its attempt counts in the *durable* attempt records and (for a resume
  point) every component re-hashed; the decision is recorded as ``resume-tier``;
* read: a save held by both tiers is read locally, each component falling back
  to the durable copy when the local one does not verify;
* gc: each tier on its own;
* many ranks (``rank`` set, :mod:`.parts`): the local tier holds this rank's
  part of each save under the coordinator's record bytes (version 3: its
  part's pieces, its piece writer and durable intent knowing that part only);
  the coordinator's resume point is local only when every other rank
  (``peers``) holds it.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import blake3

from ..core.collector import GcReport
from ..core.fencing import AttemptView
from ..core.one_tier import OneTier
from ..core.piece_deadlines import PieceDeadline
from ..core.pieces import PieceWriter
from ..core.reader import Reader, VerifyReport
from ..core.writer import StagedSave, WriterContext, publish, publish_part, seal_record
from ..errors import (
    CkptStoreError,
    CommitUnknownError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    ResumeRefusedError,
    StoreUnavailableError,
    TransientError,
)
from ..protocol import AttemptRecord, CommitRecord, ComponentEntry, run_record_key
from ..protocol.selection import SaveInfo, SaveRef, SaveState, Selection
from ..retry import RetryPolicy
from ..util.shutdown import before_pools_stop
from .durable_copy import EarlyUploads
from .durable_intent import DurableIntent
from .local import MAX_RUN_RECORD, LocalTier
from .parts import PartCopier, part_record
from .peer_copies import PEER_WAIT_SECONDS, PeerCopies, open_peer_folder
from .replicator import ReplicationStatus, Replicator

T = TypeVar("T")

#: Errors of a local read after which the durable copy of the same save is read instead.
LOCAL_READ_FAILURES = (CorruptionError, NotFoundError, StoreUnavailableError, OSError)


def _newer(a: SaveRef | None, b: SaveRef | None) -> bool:
    """``a`` is a newer save than ``b`` (by step, then attempt)."""
    return a is not None and (b is None or (a.step, a.attempt) > (b.step, b.attempt))


def stream_with_fallback(local: Callable[[], Iterator[bytes]], durable: Callable[[], Iterator[bytes]]
                         ) -> Iterator[bytes]:
    """The chunks of ``local()``; when it fails with one of
    :data:`LOCAL_READ_FAILURES` after ``n`` bytes were handed out, the rest of
    ``durable()`` from offset ``n``. The durable stream is read from its start
    and verified whole (its last chunk comes only after its digest matched), and
    its first ``n`` bytes must hash the same as the local bytes already handed
    out: if they do not, the consumer holds bad bytes and :class:`CorruptionError`
    says to read the component again (the next read goes to the durable copy
    only if the local copy is still bad: use ``latest_complete(deep=True)``)."""
    sent = 0
    seen = blake3.blake3()
    try:
        for block in local():
            seen.update(block)
            sent += len(block)
            yield block
        return
    except LOCAL_READ_FAILURES as exc:
        why = f"{type(exc).__name__}: {exc}"[:300]
    prefix = blake3.blake3()
    off = 0
    for block in durable():
        n = len(block)
        if off < sent:
            take = min(n, sent - off)
            prefix.update(block[:take])
            off += take
            if off == sent and prefix.digest() != seen.digest():
                raise CorruptionError(
                    f"the local copy failed after {sent} bytes were handed out ({why}), and those bytes differ "
                    "from the durable copy: discard what was read and read the component again")
            if take == n:
                continue
            block = block[take:]
        off += len(block)
        yield block
    if off < sent:  # the durable stream verified but is shorter than what the local one handed out
        raise CorruptionError(f"the local copy handed out {sent} bytes, more than the durable copy holds ({off}); "
                              "discard what was read")


class _EarlyStaged(StagedSave):
    """A local save whose components :class:`EarlyUploads` copies as they land."""

    def __init__(self, ctx: WriterContext, step: int, save_id: str, early: EarlyUploads) -> None:
        super().__init__(ctx, step, save_id)
        self.early = early

    def put(self, name: str, data: Any) -> ComponentEntry:
        entry = super().put(name, data)
        self.early.start(self.save_id, entry)
        return entry

    def put_many(self, items: Sequence[tuple[str, Any]]) -> dict[str, ComponentEntry]:
        entries = super().put_many(items)
        for entry in entries.values():
            self.early.start(self.save_id, entry)
        return entries


class PeerCopiesOffWarning(UserWarning):
    """No longer raised: peer copies now work on every protocol version (a version-3 part travels as
    the pieces its holder lacks). Kept for one release so that warning filters naming it still import."""


class NotDurableAtExitWarning(UserWarning):
    """The interpreter exits with local saves the durable tier does not hold yet
    (the store was not closed, and its ``close_flush_seconds`` ran out at exit)."""


#: tier sets whose replicator runs (their store was not closed): flushed at interpreter exit
_OPEN: weakref.WeakSet[TierSet] = weakref.WeakSet()


def _flush_at_exit() -> None:
    """At interpreter exit (``util.shutdown``: while thread pools still take work,
    after the Checkpointer's in-flight saves settled): every tiered store not closed
    waits up to its ``close_flush_seconds`` for replication, then warns with the
    count of saves still local only and the fix. The replicator thread is a
    daemon, so without this the newest save would silently stay local."""
    for tiers in list(_OPEN):
        tiers.leave()


before_pools_stop(_flush_at_exit)


class TierSet:
    """The local tier, the replicator and the rules that join them to the durable
    store: the two-tier placement (:class:`ckptstore.placement.Placement`)."""

    #: a local tier stands in front of the durable one (``CheckpointStore.tiered``)
    tiered = True

    def __init__(
        self, root: str | os.PathLike[str], durable: OneTier, retry: RetryPolicy | None, *, keep: int, every: int,
        max_lag: int, early: bool = False, rank: int | None = None, peers: Mapping[int, Mapping[str, Any]] | None = None,
        exit_flush_seconds: float = 30.0, peer_job: Any = None, peer_copies: int | None = None,
    ) -> None:
        #: the durable tier (the one source of truth for identity, attempts and fencing)
        self.durable = durable
        durable_io, durable_attempts, identity_digest, auth = durable.io, durable.attempts, durable.identity_digest, \
            durable.auth
        self.durable_io = durable_io
        #: how long interpreter exit waits for replication when the store was not closed (``close_flush_seconds``)
        self.exit_flush_seconds = exit_flush_seconds
        self.durable_attempts = durable_attempts
        self.ledger = durable.ledger
        self.retry = retry or RetryPolicy()
        self.keep, self.every, self.max_lag = keep, every, max_lag
        #: this process's rank in a multi-rank job (its local tier holds its part, ``tiers.parts``); None: one process
        self.rank = rank
        #: the coordinator of a multi-rank job: every other rank's report of what it holds verified locally
        #: (``{rank: {"held": [{"step", "attempt", "save_id", "manifest_digest"}, ...], "reasons": [...]}}``)
        self.peers = dict(peers) if peers is not None else None
        #: the newest step this process's local tier could have resumed from (before the all-ranks check)
        self._local_newest: int | None = None
        #: the job's tier root (rank ``r``'s tier is ``<root>/rank-<r>``; its peer copies below it)
        self.root = root
        self.local = LocalTier(root, durable_io.run_id, durable_attempts, identity_digest, auth, retry, part=rank,
                               durable_url=durable_io.backend.url)
        #: many ranks: the peer copies' transport and write-back outcome (``distributed.peer_link.PeerSetup``)
        self.peer_job = peer_job
        self.peer_copies_asked = peer_copies
        #: this rank's copies to and from its peers (None: off, :attr:`peers_off` says why)
        self.peer_copies: PeerCopies | None = None
        self.peers_off: str | None = None if rank is None else "not started"
        self._run_record: bytes | None = None
        self.local.attempts.on_ignored = self._ignored_attempt
        self.local.io.layout_or_none = durable_io.layout  # the durable run record decides the naming
        self.reader = Reader(self.local.catalog)
        self.replicator: Replicator | None = None
        self.last_local: SaveRef | None = None
        self.attempt: AttemptRecord | None = None
        self.writer_id = ""
        #: the last resume decision (what the ``resume-tier`` event recorded)
        self.resume_decision: dict[str, Any] | None = None
        self._local_reasons: list[str] = []
        #: called with each component name the replicator copied (tests use it to kill at a chosen point)
        self.on_component: Callable[[str], None] | None = None
        #: version 3 (pieces): the window and intent lifetime of both tiers' writers and gc
        self.piece_timing = durable.timing
        #: version 3: the local piece writer (local saves skip the pieces the local tier holds)
        self.pieces: PieceWriter | None = None
        #: version 3: the replicator's save intent in the durable tier
        self.durable_intent: DurableIntent | None = None
        #: components copied to the durable tier while their save is still written locally
        # (one process only: a rank of many copies its part after the local commit, ``tiers.parts``)
        self.early = EarlyUploads(self.local.io, durable_io) if early and rank is None else None

    # ------------------------------------------------------------------ open
    def _ignored_attempt(self, number: int, why: str) -> None:
        """A local attempt record the durable tier never had: recorded (best
        effort), never counted (:class:`~ckptstore.tiers.local.MirroredAttempts`)."""
        try:
            self.record("local-attempt-ignored", {"number": number, "why": why[:300], "tier": str(self.local.root)})
        except CkptStoreError:
            pass

    def prepare(self) -> None:
        """Before the attempt is registered or joined: mirror the run record and attempts."""
        data = self.durable_io.get_bounded(run_record_key(self.durable_io.run_id), MAX_RUN_RECORD)
        self._run_record = data
        self.local.mirror(data, self.durable_attempts.load())

    def resume_point(self, view: AttemptView, deep: bool, memo: set[str] | None, writer_id: str) -> SaveRef | None:
        """The newest save complete in either tier (the ``select`` of attempt registration)."""
        durable: SaveRef | None = None
        refused: ResumeRefusedError | None = None
        try:
            durable = self.durable.resume_point(view, deep, memo, writer_id)
        except ResumeRefusedError as exc:
            refused = exc
        local, reasons = self.local.select(deep, view, durable)
        self._local_newest = local.step if local is not None else None
        if local is not None and self.peers is not None:
            newest = local
            local = self._held_by_all(local, reasons)
            if local is None:
                local = self._older_held_by_all(newest, durable, view, deep, reasons)
        self._local_reasons = reasons
        if refused is not None and local is None:
            raise refused
        if local is not None and durable is not None and (local.step, local.attempt) == (durable.step, durable.attempt):
            return replace(local, tier="both")
        return local if _newer(local, durable) else durable

    def _held_by_all(self, local: SaveRef, reasons: list[str]) -> SaveRef | None:
        """``local`` when every other rank reported its part of that exact record
        verified in its own local tier (all ranks or none), else None."""
        assert self.peers is not None
        lacking = []
        for r, report in sorted(self.peers.items()):
            held = report.get("held") or []
            if not any(isinstance(h, Mapping) and h.get("manifest_digest") == local.manifest_digest
                       and h.get("save_id") == local.save_id for h in held):
                lacking.append(r)
        if not lacking:
            return local
        reasons.append(f"step {local.step}: rank(s) {lacking} do not hold their part verified locally; "
                       "every rank reads the durable copy (all ranks or none)")
        return None

    def _older_held_by_all(self, newest: SaveRef, durable: SaveRef | None, view: AttemptView, deep: bool,
                           reasons: list[str]) -> SaveRef | None:
        """The newest save older than ``newest`` and newer than ``durable`` that
        every other rank reported holding verified and this tier accepts."""
        assert self.peers is not None
        common: set[tuple[int, int, str, str]] | None = None
        for report in self.peers.values():
            mine = {(int(h["step"]), int(h["attempt"]), str(h["save_id"]), str(h["manifest_digest"]))
                    for h in (report.get("held") or []) if isinstance(h, Mapping)
                    and isinstance(h.get("step"), int) and isinstance(h.get("attempt"), int)}
            common = mine if common is None else common & mine
        floor = (durable.step, durable.attempt) if durable is not None else (-1, -1)
        for step, attempt, sid, digest in sorted(common or (), reverse=True):
            if not floor < (step, attempt) < (newest.step, newest.attempt):
                continue
            ref = self.local.candidate(step, attempt, view, deep)
            if ref is not None and (ref.save_id, ref.manifest_digest) == (sid, digest):
                reasons.append(f"step {step}: every rank holds its part verified locally")
                return ref
        return None

    def begin(self, attempt: AttemptRecord, writer_id: str, resumed: SaveRef | None, *, verified: bool,
              joined: bool) -> None:
        """``attempt`` was registered (:meth:`start`) or joined by a member rank (:meth:`join`)."""
        if joined:
            self.join(attempt, writer_id)
        else:
            self.start(attempt, writer_id, resumed, self.durable.newest_step())

    def start(self, attempt: AttemptRecord, writer_id: str, resumed: SaveRef | None, durable_newest: int | None) -> None:
        """After registration: mirror the new attempt, record ``resume-tier``,
        start replicating (the resumed save first when only the local tier has it)."""
        self.join(attempt, writer_id, resumed)
        assert self.replicator is not None
        if resumed is not None and resumed.tier != "local":
            self.replicator.mark_durable(resumed)
        self.resume_decision = {
            "tier": None if resumed is None else ("local" if resumed.tier != "durable" else "durable"),
            "step": resumed.step if resumed else None, "save_id": resumed.save_id if resumed else None,
            "durable_newest_step": durable_newest,
            "local_quarantined": self.local.quarantined,
            "local_ignored_attempts": sorted(self.local.ignored_attempts)[:20],
            "local_reasons": self._local_reasons[:20],
            "steps_lost_with_local_tier": self._steps_lost(resumed),
        }
        if self.peers is not None:
            self.resume_decision["world_size"] = len(self.peers) + 1
            self.resume_decision["ranks"] = {  # per rank: the steps it holds verified, why others were refused
                str(r): {"held_steps": [h.get("step") for h in (rep.get("held") or []) if isinstance(h, Mapping)][:5],
                         "reasons": [str(x)[:300] for x in (rep.get("reasons") or [])][:5]}
                for r, rep in sorted(self.peers.items())}
            sources = getattr(self.peer_job, "sources", None) or {}
            for r, src in sorted(sources.items()):  # where each rank's part came from: its own disk or a peer
                self.resume_decision["ranks"].setdefault(str(r), {})["source"] = src
            self.resume_decision["peer_copies"] = self.peers_off or "on"
            self.resume_decision["newest_held_by_every_rank"] = getattr(self.peer_job, "newest_everywhere", None)
        self.record("resume-tier", self.resume_decision)
        if resumed is not None and resumed.tier == "local":
            self.replicator.submit(resumed, force=True)

    def _start_pieces(self, attempt: AttemptRecord, resumed: SaveRef | None) -> None:
        """Version 3: the local piece writer knows the resumed save's pieces when
        the local tier holds it; the durable intent knows them when the durable
        tier does (its standing intent is written now)."""
        if self.pieces is not None:
            self.pieces.close()
        self.pieces = PieceWriter(self.local.io, attempt.number, self.piece_timing)
        self.durable_intent = DurableIntent(self.durable_io, attempt.number, self.piece_timing)
        if resumed is not None:
            self._learn_pieces(resumed, resumed.tier, durable_whole=True)
        else:
            self.pieces.learn(None)

    def _learn_pieces(self, ref: SaveRef, tier: str, *, durable_whole: bool) -> None:
        """Version 3: the pieces of ``ref`` that this process's next save and
        next replication may skip. On many ranks each tier's writer learns only
        this rank's part (its local tier holds only that part; its replication
        uploads only that part), except the coordinator's durable intent with
        ``durable_whole`` (it names every piece of the records it commits)."""
        if self.pieces is None or self.durable_intent is None:
            return
        own = part_record(ref.record, self.rank)
        if tier in ("local", "both"):
            self.pieces.learn(own)
        if tier in ("durable", "both"):
            whole = durable_whole and (self.rank is None or self.rank == 0)
            self.durable_intent.learn(ref.record if whole else own)

    def join(self, attempt: AttemptRecord, writer_id: str, resumed: SaveRef | None = None) -> None:
        """Mirror ``attempt`` and start the replicator (a member rank joins the
        coordinator's attempt this way; :meth:`start` for the registering process)."""
        self.attempt, self.writer_id = attempt, writer_id
        self.local.add_attempt(attempt)
        if self.durable_io.layout.pieces:
            self._start_pieces(attempt, resumed)
        self.replicator = Replicator(
            self.local.io, self.durable_io, self.durable_attempts, every=self.every, max_lag=self.max_lag,
            retry=self.retry, record=lambda k, p: self.record(k, p), after=self._retain,
            on_component=lambda n: self.on_component(n) if self.on_component is not None else None,
            intent=self.durable_intent, early=self.early, timing=self.piece_timing,
            copy=PartCopier(self.rank, timing=self.piece_timing, intent=self.durable_intent)
            if self.rank is not None else None,
        )
        self._start_peer_copies()
        _OPEN.add(self)

    def _start_peer_copies(self) -> None:
        """Many ranks: start this rank's side of the peer copies (``tiers.peer_copies``),
        or say why they are off (:attr:`peers_off`, ``replication_status().peer_copies``)."""
        job = self.peer_job
        if self.rank is None or self.peer_copies is not None:
            return
        if job is None or job.link is None:
            self.peers_off = getattr(job, "off", None) or "no peer transport (open with open_distributed)"
            return
        run_id = self.durable_io.run_id

        def read(key: str, entry: ComponentEntry) -> Iterator[bytes]:
            return self.local.io.verified_chunks(key, entry, f"rank {self.rank}'s local copy of "
                                                            f"{key.rsplit('/', 1)[-1]!r}")

        self.peer_copies = PeerCopies(job.link, job.receivers, run_id=run_id, read=read, folder=self._peer_folder,
                                      keep=self.keep, record=lambda k, p: self.record(k, p))
        self.peers_off = None

    def _peer_folder(self, sender: int) -> LocalTier:
        """The folder this rank keeps of ``sender``'s parts, its records mirrored from the durable tier."""
        assert self.rank is not None and self.attempt is not None
        tier = open_peer_folder(self.root, self.rank, sender, self.durable_io.run_id, self.durable_attempts,
                                self.local.identity_digest, self.local.auth, self.retry, self.durable_io.backend.url)
        tier.io.layout_or_none = self.durable_io.layout  # the durable run record decides the naming
        data = self._run_record or self.durable_io.get_bounded(run_record_key(self.durable_io.run_id), MAX_RUN_RECORD)
        tier.mirror(data, self.durable_attempts.load())
        tier.add_attempt(self.attempt)
        return tier

    def acknowledged(self, ref: SaveRef) -> None:
        """Every rank committed its part of ``ref`` (many ranks): copy this rank's part to its peers and
        wait until they landed (a save is complete when its peer copies are: the Checkpointer's
        asynchronous save waits on its own thread, never the loop), at most the job's channel timeout
        (``peer_job.wait_seconds``; past it the copy goes on in the background, recorded as
        ``peer-copy-late``). A peer gone during them (the link failed) is :class:`CommitUnknownError`:
        the save is committed on every rank but not complete (raised on each rank whose copies needed
        that peer). Otherwise the coordinator queues an ``acknowledged`` ledger entry (sent by the
        replication thread, never blocking): what ``steps_lost_with_local_tier`` counts from after a
        node is lost."""
        copies = self.peer_copies
        if copies is not None:
            running = copies.active and copies.stopped is None
            wait = float(getattr(self.peer_job, "wait_seconds", PEER_WAIT_SECONDS))
            outcome = copies.wait(copies.submit(ref), wait)
            if outcome == "late":
                with contextlib.suppress(CkptStoreError, OSError):  # the ledger is best effort here
                    self.record("peer-copy-late", {"rank": self.rank, "step": ref.step, "waited_seconds": wait})
            if running and outcome == "stopped":
                # a peer went away during this save's copies (a node lost with it, perhaps): the save is
                # committed on every rank but held on one node only; as a save whose acknowledgement is
                # lost, it is not acknowledged (a restart may still resume from it where every part is held)
                raise CommitUnknownError(
                    f"save of step {ref.step} ({ref.save_id}): committed on every rank, but its peer copies "
                    f"did not land ({copies.stopped}); the save is not complete. Nothing was deleted; the "
                    "previous complete save stays, and a restart resumes from this one if every rank's part "
                    "is still held somewhere")
            # refused, skipped or late (the thread recorded why): the save returns as complete, not copied
            # (or not yet); acknowledged as any save, so steps_lost_with_local_tier never undercounts
        if self.rank == 0 and self.replicator is not None:
            self.replicator.queue_event("acknowledged", {"step": ref.step, "save_id": ref.save_id})

    def adopt_resume_point(self, ref: SaveRef) -> None:
        """A member rank learnt the job's resume point: the coordinator's tier
        decision holds here too; a save only the local tiers hold is queued for
        replication (this rank's part)."""
        if self.replicator is None:
            return
        if ref.tier == "local":
            self.replicator.submit(ref, force=True)
        else:
            self.replicator.mark_durable(ref)

    def _steps_lost(self, resumed: SaveRef | None) -> int:
        """Steps between the newest save the ledger knows of and the resume point."""
        try:
            events = self.ledger.read().events
        except CkptStoreError:
            return 0
        newest = max((int(e.payload["step"]) for e in events
                      if e.event in ("save", "acknowledged", "replicated", "replication-skipped", "preempted")
                      and isinstance(e.payload.get("step"), int)), default=None)
        # the newest save known to have been made: on many ranks, the newest the ledger names (each
        # acknowledged save, each replication) or whose every part was held somewhere (own folders, peer
        # copies) — never a rank's newer local commit that was not acknowledged; in one process, also its
        # newest local save
        reach = getattr(self.peer_job, "newest_everywhere", None) if self.peers is not None else self._local_newest
        if isinstance(reach, int):
            newest = reach if newest is None else max(newest, reach)
        if newest is None:
            return 0
        return max(0, newest - (resumed.step if resumed is not None else -1))

    def adopt(self, attempt: AttemptRecord) -> None:
        """A new attempt registered by ``fall_back``: mirror it."""
        self.attempt = attempt
        self.local.add_attempt(attempt)
        if self.pieces is not None:  # the new attempt's intents; nothing known (the resume point was given up)
            self.pieces.close()
            self.pieces = PieceWriter(self.local.io, attempt.number, self.piece_timing)
            self.pieces.learn(None)
        if self.durable_intent is not None:
            self.durable_intent.attempt = attempt.number
            self.durable_intent.forget()

    def record(self, kind: str, payload: Mapping[str, Any]) -> None:
        if self.rank is not None and self.rank != 0:
            # a member's replicator uploads its part only: the durable commit is the coordinator's "replicated"
            kind = "replicated-part" if kind == "replicated" else kind
            payload = {**payload, "rank": self.rank}
        self.ledger.append(kind, payload, self.attempt.number if self.attempt else None)

    # ------------------------------------------------------------------ save
    def stage(self, ctx: WriterContext, step: int, save_id: str) -> StagedSave:
        """A local save (``ctx``, the durable writer's, is not used: the local
        tier has its own); when the replicator would take it at once, each
        component is also copied to the durable tier as soon as it is written."""
        assert self.attempt is not None and self.replicator is not None
        ctx = self.local.writer(self.attempt, self.writer_id, self.pieces)
        if self.early is not None and self.replicator.takes_next():
            return _EarlyStaged(ctx, step, save_id, self.early)
        return StagedSave(ctx, step, save_id)

    def publish(
        self, ctx: WriterContext, step: int, save_id: str, components: Mapping[str, ComponentEntry], *,
        metadata: Mapping[str, Any] | None, ranks: Mapping[int, Sequence[str]] | None, world_size: int | None,
        expect: Sequence[str], rank_pieces: Mapping[int, PieceDeadline] | None = None,
    ) -> SaveRef:
        """Publish locally (the local backend's atomic commit), queue for replication. ``rank_pieces``
        is not needed here: every rank checks its own part again when it commits it in its local tier."""
        assert self.attempt is not None and self.replicator is not None
        ctx = self.local.writer(self.attempt, self.writer_id, self.pieces)
        if self.rank is not None and ranks is not None:
            # many ranks: the coordinator seals the one record and publishes its own part here;
            # every other rank publishes the same bytes for its part (publish_record)
            rec = seal_record(ctx, step, save_id, components, metadata=metadata, ranks=ranks, world_size=world_size)
            ref = publish_part(ctx, rec, list(ranks.get(self.rank, ())))
            self._learn_part(ref)
        else:
            ref = publish(ctx, step, save_id, components, metadata=metadata, ranks=ranks, world_size=world_size,
                          expect=expect)
        return self._published(ref)

    def learn_published(self, ref: SaveRef) -> None:
        """A member rank learns the job's resume point (``ref.tier``: the
        coordinator's tier decision): version 3, its next save skips the
        pieces of its part the local tier holds, its next replication those
        the durable tier holds. (It learns the saves it publishes itself in
        :meth:`publish_record`.) One process: nothing to learn here."""
        if self.rank is not None:
            self._learn_pieces(ref, ref.tier, durable_whole=False)

    def _learn_part(self, ref: SaveRef) -> None:
        """Version 3: this rank's part of ``ref`` was committed locally: the next
        local save skips its pieces (the intent naming them is written now)."""
        if self.pieces is not None:
            self.pieces.learn(part_record(ref.record, self.rank))

    def publish_record(self, ctx: WriterContext, data: bytes) -> SaveRef:
        """A member rank: publish the coordinator's commit record (its exact
        bytes) in this rank's local tier for this rank's part, queue it for
        replication."""
        if self.rank is None:
            raise InvalidInputError("publish_record needs a store opened on many ranks "
                                    "(ckptstore.distributed.open_distributed(..., options=OpenOptions(tiers=...)))")
        assert self.attempt is not None
        rec = CommitRecord.decode(data, "the coordinator's commit record", run_id=self.durable_io.run_id)
        if rec.encode() != data:
            raise CorruptionError("the coordinator's commit record is not in canonical form; not published")
        ctx = self.local.writer(self.attempt, self.writer_id, self.pieces)
        ref = publish_part(ctx, rec, sorted((rec.ranks or {}).get(self.rank, ())))
        self._learn_part(ref)
        return self._published(ref)

    def _published(self, ref: SaveRef) -> SaveRef:
        assert self.replicator is not None
        ref = replace(ref, tier="local")
        self.last_local = ref
        self.replicator.submit(ref)
        return ref

    def make_durable(self, timeout: float | None) -> bool:
        """Force the newest local save into the queue (if not there or durable) and wait for it."""
        ref, rep = self.last_local, self.replicator
        if rep is None or ref is None:
            return True
        if not rep.is_durable(ref.save_id) and not rep.is_queued(ref.save_id):
            rep.submit(ref, force=True)
        rep.flush(timeout)
        return rep.is_durable(ref.save_id)

    def _retain(self, pending: int) -> None:
        self.local.gc(keep_last=self.keep + pending, timing=self.piece_timing)

    # ------------------------------------------------------------- selection
    def select(self, deep: bool, explain: bool) -> Selection:
        """The newest save complete in either tier, tier-tagged."""
        try:
            dsel = self.durable.select(deep, explain)
        except (StoreUnavailableError, TransientError) as exc:
            # the durable tier is away: the local tier alone, judged by its mirror of the attempts
            local, reasons = self.local.select(deep, None, None, own=True)
            note = f"durable tier unavailable: {type(exc).__name__}: {exc}"[:500]
            return self.local.explain(Selection(None, [], notes=(note,)), local, reasons)
        durable = dsel.latest
        local, reasons = self.local.select(deep, None, durable)
        chosen = durable
        if local is not None and durable is not None and (local.step, local.attempt) == (durable.step, durable.attempt):
            chosen = replace(local, tier="both")
        elif _newer(local, durable):
            chosen = local
        return self.local.explain(dsel, chosen, reasons)

    def list_saves(self, deep: bool, grace: float) -> list[SaveInfo]:
        """Both tiers' saves, one row per save ID (tier on the ref)."""
        durable = self.durable.list_saves(deep, grace)
        try:
            local = self.local.catalog.list_saves(self.local.catalog.scan(), deep, grace)
        except CkptStoreError:
            local = []
        by_id = {i.save_id: i for i in durable}
        out = list(durable)
        for li in local:
            di = by_id.get(li.save_id)
            if li.state is not SaveState.COMMITTED or li.ref is None:
                continue
            if di is None:
                out.append(replace(li, ref=replace(li.ref, tier="local"), selected=False))
            elif di.state is SaveState.COMMITTED and di.ref is not None \
                    and di.ref.manifest_digest == li.ref.manifest_digest:
                out[out.index(di)] = replace(di, ref=replace(di.ref, tier="both"))
        out.sort(key=lambda i: (i.step, i.attempt), reverse=True)
        return out

    def get_save(self, step: int, attempt: int | None) -> SaveRef:
        """The durable commit of ``step``, else the local one (tagged ``local``); not verified."""
        try:
            return self.durable.get_save(step, attempt)
        except NotFoundError:
            return replace(self.local.catalog.get_save(step, attempt), tier="local")

    def newest_step(self) -> int | None:
        return self.durable.newest_step()

    # --------------------------------------------------------------- reading
    def read(self, ref: SaveRef, how: Callable[[Reader], T]) -> T:
        """``how`` on the local reader for a save the local tier holds; for one
        held by both tiers, on the durable reader when the local read fails (a
        corrupt, truncated or missing local copy never reaches the caller)."""
        if ref.tier == "durable":
            return how(self.durable.reader)
        if ref.tier == "local":
            return how(self.reader)
        try:
            return how(self.reader)
        except LOCAL_READ_FAILURES:
            return how(self.durable.reader)

    def stream(self, ref: SaveRef, how: Callable[[Reader], Iterator[bytes]]) -> Iterator[bytes]:
        """Stream a component of ``ref``: from the local tier when it holds the
        save, and for a save held by both tiers, on from the durable copy at the
        same offset when the local stream fails part way (see :func:`stream_with_fallback`)."""
        if ref.tier == "durable":
            return how(self.durable.reader)
        if ref.tier == "local":
            return how(self.reader)
        return stream_with_fallback(lambda: how(self.reader), lambda: how(self.durable.reader))

    def verify(self, ref: SaveRef, deep: bool) -> VerifyReport:
        """The copy ``ref`` names checked: the local one for a local-only save, else the durable one."""
        return (self.reader if ref.tier == "local" else self.durable.reader).verify(ref, deep=deep)

    # ------------------------------------------------------------ operations
    def queue_event(self, kind: str, payload: Mapping[str, Any]) -> bool:
        """The durable ledger is away: the replication thread sends the entry when it is back."""
        if self.replicator is None:
            return False
        self.replicator.queue_event(kind, payload)
        return True

    def status(self) -> ReplicationStatus | None:
        if self.replicator is None:
            return None
        st = self.replicator.status()
        if self.rank is None:
            return st
        pc = self.peer_copies
        state = self.peers_off or (f"stopped: {pc.stopped}" if pc is not None and pc.stopped else "on")
        return replace(st, peers=pc.status() if pc is not None else (), peer_copies=state)

    def flush(self, timeout: float | None) -> bool:
        """Wait for the background work: this rank's peer copies (many ranks), then replication."""
        end = None if timeout is None else time.monotonic() + timeout
        if self.peer_copies is not None and not self.peer_copies.flush(timeout):
            return False
        left = None if end is None else max(0.0, end - time.monotonic())
        return True if self.replicator is None else self.replicator.flush(left)

    def is_durable(self, ref: SaveRef) -> bool:
        """Whether ``ref`` is committed in the durable tier."""
        if ref.tier in ("durable", "both"):
            return True
        if self.replicator is not None and self.replicator.is_durable(ref.save_id):
            return True
        try:
            return self.durable.get_save(ref.step, ref.attempt).manifest_digest == ref.manifest_digest
        except CkptStoreError:
            return False

    def gc_local(self, *, keep_last: int, dry_run: bool, deep: bool, grace_seconds: float) -> GcReport:
        return self.local.gc(keep_last=keep_last, dry_run=dry_run, deep=deep, grace_seconds=grace_seconds,
                             timing=self.piece_timing)

    def leave(self) -> None:
        """At interpreter exit, the store not closed: replicate what is pending
        (bounded by ``exit_flush_seconds``), else warn with the count and the fix."""
        rep = self.replicator
        if rep is None or not rep.status().pending:
            return
        if rep.flush(self.exit_flush_seconds):
            return
        left = rep.status().pending
        warnings.warn(
            f"{self.local.root}: {len(left)} local save(s) (step(s) {', '.join(map(str, left))}) are not in the "
            f"durable tier {self.durable_io.backend.url} at exit ({self.exit_flush_seconds:g} s waited): they stay "
            "on this machine only. Fix: close the store (CheckpointStore.close() or a with block) and call "
            "make_durable(timeout) before exiting, or raise close_flush_seconds; the next open on this machine "
            "resumes from the local copy and replicates it",
            NotDurableAtExitWarning, stacklevel=1)

    def close(self) -> None:
        """Wait up to ``close_flush_seconds`` for replication, stop it, release the local tier."""
        _OPEN.discard(self)
        if self.peer_copies is not None:
            self.peer_copies.close(min(self.exit_flush_seconds, 30.0))
        if self.replicator is not None:
            self.replicator.flush(self.exit_flush_seconds)
            self.replicator.close()
        if self.pieces is not None:
            self.pieces.close()
        self.local.backend.close()
        self.durable.close()
