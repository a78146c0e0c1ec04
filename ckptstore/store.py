"""CheckpointStore: the public facade over the engine.

Each job lives in its own module of :mod:`ckptstore.core` (whose docstring
holds the one written layer order); this module only wires them together.
The sequences are specified in ``protocol_spec/PROTOCOL.md``; keep the two in step.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import blake3

from .backends.base import Backend
from .core.binding import bind_identity, read_identity, read_run_record
from .core.bounded_io import RunIO
from .core.collector import GcReport, Retention, collect
from .core.fencing import AttemptLog
from .core.hashing import CHUNK
from .core.intents import PieceTiming
from .core.ledger import Ledger
from .core.one_tier import OneTier
from .core.piece_deadlines import PieceDeadline
from .core.piece_reads import pieces_lacking
from .core.preflight import check_can_write, check_metadata, check_open_args
from .core.reader import VerifyReport
from .core.record_auth import RecordAuth
from .core.resume_point import fallback_candidates
from .core.signing import SignReport, sign_run
from .core.writer import SaveWriter, StagedSave, WriterContext, check_save_id
from .defaults import DEFAULT_GRACE_SECONDS
from .errors import CorruptionError, InvalidInputError, StoreUnavailableError
from .identity import RunIdentity, identity_digest, normalize_identity
from .options import OpenOptions, check_combination, new_run_version, options_from_keywords
from .placement import Placement, open_placement
from .protocol import (
    AttemptRecord,
    ComponentEntry,
    layout_of,
    new_save_id,
    run_prefix,
    validate_component_name,
    validate_run_id,
    validate_step,
)
from .protocol.auth import AuthPolicy
from .protocol.records import PieceRef
from .protocol.selection import SaveInfo, SaveRef, Selection
from .tiers.replicator import ReplicationStatus

__all__ = [
    "DEFAULT_GRACE_SECONDS", "CheckpointStore", "GcReport", "OpenOptions", "SaveInfo", "SaveRef", "SaveWriter", "Selection",
    "ReplicationStatus", "StagedSave", "VerifyReport",
]

ResumeFrom = int | None | Literal["latest"]
T = TypeVar("T")


def _listed(head: str, items: Sequence[str], limit: int = 8) -> str:
    """``head: a; b; ... (N more)``: a message with at most ``limit`` reasons shown."""
    shown = "; ".join(items[:limit]) + (f"; ... ({len(items) - limit} more)" if len(items) > limit else "")
    return f"{head}: {shown}" if items else head


class CheckpointStore:
    """Crash-consistent checkpoints of one run on one backend.

    Open with :meth:`open`. A store opened for writing (``mode="w"``, the
    default when an ``identity`` is given) binds or checks the run identity and
    registers a new *attempt* whose number fences older writers (or joins the
    attempt a coordinator registered: ``join_attempt``); a store opened for
    reading registers nothing and writes nothing.

    Thread safety: one store may be shared by threads; each ``save()`` is
    independent. Across processes, every guarantee rests on the backend's
    atomic create-if-absent.

    The methods, by who calls them:

    * **Everyday** (training code): :meth:`open`, :meth:`save` (a context
      manager: put components, leave the block to commit), :meth:`latest_complete`
      (the resume point), :attr:`resumed_from`, :meth:`get_save`; reading a save
      back: :meth:`read` (one component's bytes, verified), :meth:`read_into`
      (straight into caller memory, hashed while read: the restore path),
      :meth:`iter_read`, :meth:`read_range`, :meth:`read_verified_range`,
      :meth:`component`; :meth:`close`.
    * **Operator** (the command line, dashboards, clean-up jobs):
      :meth:`list_saves`, :meth:`verify`, :meth:`gc`, :meth:`leftovers`,
      :meth:`sign`, :attr:`auth_policy`, :meth:`attempts`, :attr:`run_record`,
      :meth:`events`, :meth:`record_event`, :meth:`lineage_of`, :meth:`fall_back`.
    * **Multi-process** (a coordinator publishing for many writers, as
      :mod:`ckptstore.distributed` does): :meth:`new_save_id`, :meth:`stage`
      (write components without publishing), :meth:`publish` (one commit record
      for components written by several processes); the other processes join
      the coordinator's attempt with ``open(..., join_attempt=N)``.
    """

    def __init__(
        self, backend: Backend, run_id: str, options: OpenOptions | None = None, *,
        identity: RunIdentity | Mapping[str, Any] | None = None, mode: Literal["r", "w"] | None = None,
        resume_from: ResumeFrom = "latest", join_attempt: int | None = None,
    ) -> None:
        """Use :meth:`open` (this constructor takes the same arguments, for code
        that already holds a :class:`Backend`)."""
        o = options if options is not None else OpenOptions()
        if not isinstance(o, OpenOptions):
            raise InvalidInputError(f"options must be an OpenOptions, got {type(o).__name__}")
        #: the choices this store was opened with
        self.options = o
        resume_verify, single_writer, lineage, protocol_version = o.resume_verify, o.single_writer, o.lineage, \
            o.protocol_version
        retry = o.retry
        self.backend = backend
        self.auth = self._auth = RecordAuth(o.auth.policy, o.auth.keyring)  # public: plug-ins tag their own files
        self._resume_deep = resume_verify == "deep"
        self.run_id = validate_run_id(run_id)
        self.mode: Literal["r", "w"] = check_open_args(mode or ("w" if identity is not None else "r"),
                                                       resume_from, resume_verify)
        self._io = RunIO(backend, self.run_id, retry)
        self._attempts = AttemptLog(self._io, self._auth)
        self._ledger = Ledger(self._io, self._auth)
        self.writer_id = uuid.uuid4().hex
        self.attempt: AttemptRecord | None = None
        #: The save this attempt resumed from (``mode="w"`` with resume_from="latest").
        self.resumed_from: SaveRef | None = None
        requested = normalize_identity(identity) if identity is not None else None
        version = layout_of(protocol_version) if protocol_version is not None else None
        check_combination(o, joined=join_attempt is not None)  # before anything is written
        if self.mode == "w":
            check_can_write(backend, requested, join_attempt, single_writer)
            assert requested is not None
            self.identity = bind_identity(self._io, requested, lineage, self._auth, version,
                                          create_as=layout_of(new_run_version(o)))
        else:
            self.identity = read_identity(self._io, requested, self._auth, version)
        self.identity_digest = identity_digest(self.identity)
        self._durable = OneTier(self._io, self._attempts, self._ledger, self.identity_digest, self._auth,
                                o.pieces)
        self._catalog, self._reader = self._durable.catalog, self._durable.reader
        self._retention = Retention(self._catalog)
        self._catalog.writes_pack = self.mode == "w"
        #: where the saves live (``ckptstore.placement``): every tier-dependent step is delegated to it
        self._place: Placement = open_placement(self._durable, o.tiers, o.retry)
        if self.mode == "w":
            self._place.prepare()
            if join_attempt is not None:
                self.attempt = self._attempts.join(join_attempt)
            else:
                memo: set[str] = set()  # the re-selection after registering does not re-hash what was verified
                self.attempt, self.resumed_from = self._attempts.register(
                    self.writer_id, resume_from,
                    lambda v: self._place.resume_point(v, self._resume_deep, memo, self.writer_id))
            self._place.begin(self.attempt, self.writer_id, self.resumed_from, verified=self._resume_deep,
                              joined=join_attempt is not None)
        self._piece_timing = o.pieces

    @property
    def damaged_pieces(self) -> list[str]:
        """Version 3: what this writer's evidence checks found, one line per
        known piece that had changed, shrunk or failed its re-hash (PROTOCOL.md
        §9.2 "Evidence"), newest last; each was written again by the save that
        found it (that save is restorable). Each also came as a
        :class:`~ckptstore.core.pieces.DamagedPieceWarning`. Empty otherwise."""
        w = self._place.pieces
        return list(w.damaged) if w is not None else []

    # ------------------------------------------------------------------ open
    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str] | Backend,
        run_id: str,
        *,
        identity: RunIdentity | Mapping[str, Any] | None = None,
        mode: Literal["r", "w"] | None = None,
        resume_from: ResumeFrom = "latest",
        options: OpenOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        join_attempt: int | None = None,
        **deprecated: Any,
    ) -> CheckpointStore:
        """Open run ``run_id`` in the store at ``url``.

        ``url``: a directory path, ``file://``, ``memory://NAME``, ``s3://bucket/prefix``,
        ``gs://bucket/prefix`` (or ``gcs://``), any scheme a plug-in registered
        (:mod:`ckptstore.backends.schemes`), or a :class:`Backend`;
        ``storage_options``: the backend's own settings (credentials, endpoint).

        Writing (``mode="w"``, default when ``identity`` is given): a new run's
        identity record is created exclusively; an existing run's identity must
        match field for field or :class:`IdentityMismatchError` lists every
        difference. Then an attempt is registered that resumes from
        ``resume_from``: ``"latest"`` (the newest complete save, available as
        :attr:`resumed_from`), a step, or ``None`` for a fresh start. With
        ``join_attempt=N`` nothing is registered: the store writes as a member
        of attempt ``N``, which a coordinator registered for the whole job
        (:class:`SupersededError` if a later attempt was registered since).
        Inside a torch.distributed job of more than one rank, opening for
        writing without ``join_attempt`` is refused unless
        ``OpenOptions(single_writer=True)``.

        Reading (``mode="r"``): the run must exist; nothing is written.

        ``options``: how the store behaves, one :class:`~ckptstore.options.OpenOptions`
        (each field is documented there: the resume check, the protocol version
        of a new run, authenticated records, two tiers, the retry policy). The
        flat keywords of earlier releases (``local_tier=``, ``auth_policy=``,
        ``protocol_version=``, ...) still work for this release, with a
        :class:`DeprecationWarning` (``ckptstore.options.options_from_keywords``).
        A combination that cannot work is refused here, before anything is
        written, with the reason and the fix (``docs/combinations.md``).
        """
        from .backends.schemes import backend_from_url

        o = options_from_keywords(options, deprecated, "CheckpointStore.open")
        backend = url if isinstance(url, Backend) else backend_from_url(url, storage_options=storage_options)
        return cls(backend, run_id, o, identity=identity, mode=mode, resume_from=resume_from,
                   join_attempt=join_attempt)

    @property
    def run_record(self) -> dict[str, Any]:
        rec = read_run_record(self._io, self._auth)
        return {
            "run_id": rec.run_id, "identity": rec.identity, "identity_digest": rec.identity_digest,
            "created_at": rec.created_at, "lineage": rec.lineage, "protocol_version": rec.version,
        }

    def attempts(self) -> list[AttemptRecord]:
        """Every readable attempt record, oldest first."""
        return [r for _, r in sorted(self._attempts.load().records.items())]

    # ------------------------------------------------------------------ save
    def _writer(self) -> WriterContext:
        if self.mode != "w" or self.attempt is None:
            raise InvalidInputError("this store was opened read-only; open it with identity=... to save")
        return self._durable.context(self.attempt, self.writer_id)

    @property
    def piece_timing(self) -> PieceTiming:
        """The window and intent lifetime of this store's version-3 saves (§9.4)."""
        return self._piece_timing

    def learn_published(self, ref: SaveRef) -> None:
        """``ref`` was published by another process (a coordinator) and is
        the newest commit: this writer's next save skips its pieces (version
        3; nothing otherwise). Writes the intent naming them now."""
        self._place.learn_published(ref)

    def acknowledged(self, ref: SaveRef) -> None:
        """``ref`` was acknowledged on every rank of a job (each rank's part is
        committed): with a local tier and peer copies, this rank's part is
        copied to its peers in the background (``docs/tiers.md`` "Peer
        copies"); nothing otherwise. Never blocks."""
        self._place.acknowledged(ref)

    def new_save_id(self, step: int) -> str:
        """A fresh save ID for ``step`` of this store's attempt (a coordinator
        chooses one and hands it to every rank)."""
        return new_save_id(validate_step(step), self._writer().attempt.number)

    def stage(self, step: int, *, save_id: str | None = None) -> StagedSave:
        """Begin writing components of ``step`` without publishing them: the
        first half of a save, for a caller that publishes with :meth:`publish`
        (possibly in another process, from gathered inventories)."""
        ctx = self._writer()
        validate_step(step)
        sid = check_save_id(ctx, step, save_id) if save_id is not None else new_save_id(step, ctx.attempt.number)
        return self._place.stage(ctx, step, sid)

    def publish(
        self,
        step: int,
        save_id: str,
        components: Mapping[str, ComponentEntry],
        *,
        metadata: Mapping[str, Any] | None = None,
        ranks: Mapping[int, Sequence[str]] | None = None,
        world_size: int | None = None,
        expect: Sequence[str] = (),
        rank_pieces: Mapping[int, PieceDeadline] | None = None,
    ) -> SaveRef:
        """Publish staged components as the save ``save_id`` of ``step``: one
        listing checks every component's size, the pre-commit fence, the
        commit record created with the backend's create-if-absent, the
        post-commit fence. Raises a :class:`SaveNotPublishedError` subclass
        when the save is not acknowledged. ``rank_pieces`` (version 3, the
        coordinator of many ranks): each rank's piece deadlines, whose anchors
        are checked with the commit (PROTOCOL.md §9.4)."""
        validate_step(step)
        md = check_metadata(metadata)
        return self._place.publish(self._writer(), step, save_id, components, metadata=md, ranks=ranks,
                                   world_size=world_size, expect=expect, rank_pieces=rank_pieces)

    def save(
        self,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        expect: list[str] | None = None,
        save_id: str | None = None,
    ) -> SaveWriter:
        """Begin a save of ``step``; use as ``with store.save(step) as s: s.put(name, data)``.

        Leaving the block normally verifies the inventory (every ``put`` landed
        with its size; every name in ``expect`` present) and publishes the commit
        record with the backend's create-if-absent. An exception inside the
        block aborts: nothing is published and the written components are
        removed (best effort; ``gc`` removes what a killed process left).
        """
        md = check_metadata(metadata)
        for n in expect or []:
            validate_component_name(n)
        staged = self.stage(step, save_id=save_id)

        def publish_staged(components: Mapping[str, ComponentEntry]) -> SaveRef:
            return self.publish(step, staged.save_id, components, metadata=md, expect=list(expect or []))

        return SaveWriter(staged, publish_staged)

    # -------------------------------------------------------------- selection
    @overload
    def latest_complete(self, deep: bool = ..., *, explain: Literal[False] = ...) -> SaveRef | None: ...
    @overload
    def latest_complete(self, deep: bool = ..., *, explain: Literal[True]) -> Selection: ...

    def latest_complete(self, deep: bool = False, *, explain: bool = False) -> SaveRef | Selection | None:
        """The newest committed save that verifies, or None.

        Never a partial, corrupt or superseded save. The default check reads the
        commit record and compares every component's size by listing (no data
        read); ``deep=True`` also re-hashes every byte. With ``explain=True``
        the answer is a :class:`Selection` that also lists every newer candidate
        that was skipped and why.
        """
        sel = self._place.select(deep, explain)
        return sel if explain else sel.latest

    def get_save(self, step: int, attempt: int | None = None) -> SaveRef:
        """The commit of ``step`` (the highest attempt, unless given); not verified.
        Tiered: the durable commit, else the local one (``tier="local"``)."""
        return self._place.get_save(step, attempt)

    def list_saves(self, *, deep: bool = False, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> list[SaveInfo]:
        """Every save of the run (committed or not), newest first, with its state."""
        return self._place.list_saves(deep, grace_seconds)

    # --------------------------------------------------------------- reading
    def read(self, ref: SaveRef, name: str) -> bytes:
        """The component's bytes, verified against the commit record's size and
        BLAKE3 digest. A mismatch raises :class:`CorruptionError`; bad bytes are
        never returned."""
        return self._place.read(ref, lambda r: r.read(ref, name))

    def component(self, ref: SaveRef, name: str) -> ComponentEntry:
        """The commit's entry for one component (name, size, BLAKE3);
        :class:`NotFoundError` naming the components the save has if absent."""
        return self._reader.component(ref, name)  # from the ref's own record: the same in every tier

    def read_into(self, ref: SaveRef, name: str, out: Any) -> None:
        """Read a component straight into caller-owned memory, verified.

        ``out`` is any writable, contiguous buffer of exactly the component's
        recorded size (``ref.components[name].size``): a ``bytearray``, a
        NumPy array, a tensor's ``.numpy()``; or a list (or tuple) of such
        buffers whose sizes add up to it, filled in order as one (a scatter
        read: e.g. a header buffer, then each tensor's own memory). The bytes
        are read into it in chunks, each hashed in a helper thread while the
        next is read (one pass; a run of buffers under 1 MiB is read once and
        copied out, larger ones are read straight into). On return every byte
        matches the commit's BLAKE3; on :class:`CorruptionError` the buffers'
        content is undefined and must not be used."""
        self._place.read(ref, lambda r: r.read_into(ref, name, out))

    def iter_read(self, ref: SaveRef, name: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """Stream a component in chunks, verifying as it goes.

        The size is checked on every chunk and the digest when the last chunk
        has been read: the final chunk is yielded only after the whole
        component verified, so a consumer that reaches the end of the iterator
        has seen only verified bytes; on a mismatch :class:`CorruptionError` is
        raised instead of the last chunk. Do not act on the data before the
        iterator is exhausted. Tiered, for a save held by both tiers: when the
        local copy fails part way, the stream goes on from the durable copy at
        the same offset (that copy verified whole, and the bytes already handed
        out checked against it; ``docs/tiers.md``).
        """
        return self._place.stream(ref, lambda r: r.iter_read(ref, name, chunk))

    def read_range(self, ref: SaveRef, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a component, not verified (see :meth:`read_verified_range`)."""
        return self._place.read(ref, lambda r: r.read_range(ref, name, start, end))

    def content_digest(self, ref: SaveRef, name: str) -> str:
        """The BLAKE3 (hex) of a component's bytes, whatever their layout: the
        record's own digest for a whole component; for one stored as pieces
        (protocol version 3, whose recorded ``blake3`` names its piece list,
        and whose cuts may differ between saves of the same bytes) its bytes
        are read, verified, and hashed. Equal bytes give equal digests across
        saves, runs and versions."""
        entry = self.component(ref, name)
        if entry.pieces is None:
            return entry.blake3
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        for chunk in self.iter_read(ref, name):
            h.update(chunk)
        return h.hexdigest()

    def read_verified_range(self, ref: SaveRef, name: str, start: int, end: int, blake3_hex: str) -> bytes:
        """Bytes ``[start, end)`` of a component, checked against the BLAKE3
        digest of exactly that range (a per-item digest the caller keeps in a
        component that the commit record itself verifies)."""
        return self._place.read(ref, lambda r: r.read_verified_range(ref, name, start, end, blake3_hex))

    def verify(self, ref: SaveRef, *, deep: bool = True) -> VerifyReport:
        """Check one save against its record (sizes; with ``deep`` every digest)."""
        return self._place.verify(ref, deep)

    # ------------------------------------------------------------------- gc
    def gc(
        self,
        *,
        keep_last: int = 2,
        keep_every: int | None = None,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        dry_run: bool = False,
        deep: bool = True,
        incremental: bool = False,
    ) -> GcReport:
        """Delete what no future resume can need, keeping invariant 4.

        Kept, always: the newest complete save; the ``keep_last`` newest
        complete saves; with ``keep_every=N``, every complete save whose step
        is a multiple of N; any uncommitted save whose last write is younger
        than ``grace_seconds`` (it may be in flight); corrupt commits (evidence
        for an operator; delete them by hand), and every save directory whose
        step and attempt have a commit record, readable or not; records of a
        newer protocol version; keys under ``saves/`` that are not a save ID
        and a component name (reported in ``ignored``, never deleted). With ``deep`` (the default) every commit is re-hashed before
        anything is deleted, so a save with an undetected bit flip never counts
        as the newest complete one and the last good save behind it survives.
        Deleted: older complete saves, superseded saves, uncommitted saves
        older than the grace period, and what killed writers left behind
        (temporary files, unfinished uploads) older than the grace period. A
        committed save loses its commit record *before* its components. While
        an attempt record cannot be read, nothing is deleted (``refused``).

        ``incremental=True`` (the Checkpointer's retention after each save):
        the same rules at a cost that follows what is deleted, not the
        history: the first call is a full gc that this store remembers; later
        ones judge only what is new since, the ``keep_last`` newest saves and
        what they delete, and fall back to a full gc whenever what they judge
        again disagrees with what was remembered, the attempts changed, or the
        remembered view is older than ``grace_seconds`` (PROTOCOL.md §4.5.1).
        Uncommitted saves of other writers that appeared since the full gc,
        temporaries and the ``ignored`` report wait for the next full gc.
        """
        if keep_last < 1:
            raise InvalidInputError("keep_last must be at least 1: the newest complete save is never deleted")
        if keep_every is not None and keep_every < 1:
            raise InvalidInputError("keep_every must be at least 1")
        if grace_seconds < 0:
            raise InvalidInputError("grace_seconds must be >= 0")
        writer = self._place.pieces
        if writer is not None:  # this writer's intent after its last commit has landed and the old one is gone
            writer.settle()
        if incremental:
            return self._retention.run(keep_last=keep_last, keep_every=keep_every, grace_seconds=grace_seconds,
                                       dry_run=dry_run, deep=deep, timing=self._piece_timing)
        self._retention.forget()
        return collect(  # what a full gc judged and left is where the next incremental call starts
            self._catalog, keep_last=keep_last, keep_every=keep_every, grace_seconds=grace_seconds,
            dry_run=dry_run, deep=deep, timing=self._piece_timing, retention=None if dry_run else self._retention,
        )

    def pieces_lacking(self, ref: SaveRef, target: Backend) -> list[PieceRef]:
        """The pieces of ``ref`` (a version-3 save) that ``target`` — another
        store's backend holding the same run, e.g. a durable tier — does not
        hold with their recorded size, each once: what a replication must
        upload besides the records (components that are not pieced are not
        listed). Empty for a save of an older version."""
        return pieces_lacking(ref.record, target, self.run_id)

    def fall_back(self, to: SaveRef | None, reasons: Sequence[str]) -> None:
        """Give up this attempt's resume point before anything was saved from
        it (e.g. the restore found it corrupt): register a new attempt that
        resumes from ``to`` (None: from scratch), which takes the abandoned
        point out of the run's history, and record why in the ledger. This
        store then writes as the new attempt."""
        old, was = self._writer().attempt.number, self.resumed_from
        self.attempt, _ = self._attempts.register(self.writer_id, to.step if to is not None else None, lambda v: None)
        self.resumed_from = to
        self._place.adopt(self.attempt)
        self.record_event("resume-fallback", {
            "from_attempt": old, "from_step": was.step if was else None, "from_save_id": was.save_id if was else None,
            "to_step": to.step if to else None, "to_save_id": to.save_id if to else None,
            "attempt": self.attempt.number, "reasons": [r[:1000] for r in reasons[:20]],
        })

    def read_resume_point(
        self, ref: SaveRef, read: Callable[[SaveRef], T], check: Callable[[T, SaveRef], None] | None = None
    ) -> tuple[T, SaveRef]:
        """Read the resume point ``ref`` with ``read`` (the restore's verified
        read). If its bytes turn out corrupt (:class:`CorruptionError`; possible
        with ``resume_verify="cheap"``, which checks sizes only), read the newest
        older complete save instead, then the next, until one reads back intact:
        that one becomes the resume point by :meth:`fall_back` (a new attempt,
        ``resume-fallback`` recorded with every reason, an
        :class:`RuntimeWarning`). No intact save: :class:`CorruptionError`
        listing every reason. ``check(value, ref)`` runs on what was chosen; its
        error is raised (never a reason to fall back). Returns (value, the save
        it came from). The Checkpointer's contract
        (:class:`ckptstore.torch.contract.CheckpointerStore`; on many ranks,
        ``RankStore`` decides the same for every rank)."""
        try:
            value, chosen = read(ref), ref
        except CorruptionError as exc:
            value, chosen = self._fall_back_reading(ref, read, [f"step {ref.step} ({ref.save_id}): {exc}"])
        if check is not None:
            check(value, chosen)
        return value, chosen

    def _fall_back_reading(self, ref: SaveRef, read: Callable[[SaveRef], T], failures: list[str]) -> tuple[T, SaveRef]:
        for cand in self.fallback_candidates(ref):
            try:
                value = read(cand)
            except CorruptionError as exc:
                failures.append(f"step {cand.step} ({cand.save_id}): {exc}")
                continue
            self.fall_back(cand, failures)  # a new attempt: the corrupt save leaves the run's history
            warnings.warn(_listed(
                f"resume point step {ref.step} is corrupt; resuming from step {cand.step} instead "
                f"(attempt {self.attempt.number if self.attempt else '?'} registered)", failures),
                RuntimeWarning, stacklevel=5)
            return value, cand
        raise CorruptionError(_listed(f"run {self.run_id!r}: no complete save could be read back intact", failures))

    def fallback_candidates(self, below: SaveRef) -> list[SaveRef]:
        """The saves a resume falls back to when ``below``'s bytes turn out
        corrupt: every committed save older than it, newest first, in either
        tier (``core.resume_point.fallback_candidates``, the one rule)."""
        return fallback_candidates(self.list_saves(), below)

    def agree_preemption(self, flag: bool) -> bool:
        """The job's preemption flag: one process is its own job, so ``flag``
        (the Checkpointer's contract; on many ranks ``RankStore`` agrees it)."""
        return flag

    def alert(self) -> None:
        """A termination signal arrived: nothing to do, no peer is waited for (the Checkpointer's contract)."""

    def abandon(self) -> bool:
        """This process is leaving: False, no save of this store waits for
        another process (the Checkpointer's contract: its saves in flight at exit
        are waited for)."""
        return False

    def leftovers(self, *, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> tuple[list[str], list[str]]:
        """What killed writers left behind (temporary files, unfinished
        uploads): (younger than the grace period, older). gc removes the older."""
        prefix = run_prefix(self.run_id)
        everything = self.backend.list_incomplete(prefix, time.time() + 1e9)
        stale = set(self.backend.list_incomplete(prefix, time.time() - grace_seconds))
        return [h for h in everything if h not in stale], sorted(stale)

    def lineage_of(self, ref: SaveRef) -> dict[str, Any]:
        """The lineage record for starting a *new* run from this save's weights
        (``CheckpointStore.open(url, new_run_id, identity=..., lineage=store.lineage_of(ref))``).
        The new run is never a continuation of this one."""
        return {"source_url": self.backend.url, "source_run": self.run_id, "save_id": ref.save_id, "step": ref.step,
                "manifest_digest": ref.manifest_digest}

    @property
    def auth_policy(self) -> AuthPolicy:
        """The ``auth_policy`` this store was opened with."""
        return self._auth.policy

    def sign(self) -> SignReport:
        """Sign this run's existing records with the configured key (sidecar
        tags): the run record, attempt records, events, and every commit whose
        save re-hashes intact. Needs ``auth_policy`` other than ``"off"``."""
        if self._auth.policy is AuthPolicy.OFF:
            raise InvalidInputError("signing needs AuthOptions(policy='warn' or 'require') and a key")
        return sign_run(self._catalog)

    # --------------------------------------------------------------- events
    def record_event(self, kind: str, payload: Mapping[str, Any]) -> str:
        """Append an event to the run's ledger (created exclusively, never overwritten).

        The one write a read-only store may make, when asked: an operator (or a
        job refused before it registered an attempt) records what happened.
        On a tiered store an entry the durable tier cannot take now is queued
        and sent by the replication thread (the returned key is then ``""``):
        a durable outage never stops training."""
        try:
            return self._ledger.append(kind, payload, self.attempt.number if self.attempt else None)
        except StoreUnavailableError:
            if not self._place.queue_event(kind, payload):  # tiered: sent when the durable tier is back
                raise
            return ""

    def events(self) -> list[dict[str, Any]]:
        """The run's ledger, oldest first (unreadable entries are skipped)."""
        return [e.to_json() for e in self._ledger.read().events]

    # ---------------------------------------------------------------- tiers
    @property
    def tiered(self) -> bool:
        """Whether this store was opened with a ``local_tier``."""
        return self._place.tiered

    def replication_status(self) -> ReplicationStatus | None:
        """Where replication to the durable tier stands (lag, newest durable
        step and its age, skipped saves, failures); None for a one-tier store
        or a reader."""
        return self._place.status()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued local save is durable (or skipped); False
        when ``timeout`` seconds passed first. True at once for a one-tier store."""
        return self._place.flush(timeout)

    def make_durable(self, timeout: float | None = None) -> bool:
        """Queue the newest local save for replication even when ``replicate_every``
        skipped it, and wait up to ``timeout`` seconds: True when it is durable
        (what a preemption calls before the process exits)."""
        return self._place.make_durable(timeout)

    def is_durable(self, ref: SaveRef) -> bool:
        """Whether ``ref`` is committed in the durable tier (always true for a one-tier store)."""
        return self._place.is_durable(ref)

    def publish_record(self, data: bytes) -> SaveRef:
        """A member rank of a tiered multi-rank job: publish the coordinator's
        commit record (its exact bytes) in this rank's local tier, for the
        components the record gives this rank, and queue that part for
        replication (``ckptstore.tiers.parts``)."""
        return self._place.publish_record(self._writer(), data)

    def adopt_resume_point(self, ref: SaveRef) -> None:
        """A member rank learnt the job's resume point from the coordinator
        (``ref.tier`` is the coordinator's decision for every rank): sets
        :attr:`resumed_from`; tiered, a save only the local tiers hold is
        queued for replication (this rank's part)."""
        self.resumed_from = ref
        self._place.adopt_resume_point(ref)

    def gc_local(self, *, keep_last: int = 2, dry_run: bool = False, deep: bool = False,
                 grace_seconds: float = DEFAULT_GRACE_SECONDS) -> GcReport:
        """gc of the local tier alone (the durable tier is neither read nor
        touched; :meth:`gc` is the durable tier's and never touches the local one)."""
        if keep_last < 1:
            raise InvalidInputError("keep_last must be at least 1: the newest complete save is never deleted")
        return self._place.gc_local(keep_last=keep_last, dry_run=dry_run, deep=deep, grace_seconds=grace_seconds)

    def close(self) -> None:
        """Wait up to ``close_flush_seconds`` for replication (tiered), end this
        writer's save intent (version 3), then release the backends."""
        self._place.close()
        self.backend.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        att = self.attempt.number if self.attempt else None
        return f"CheckpointStore({self.backend.url!r}, run_id={self.run_id!r}, mode={self.mode!r}, attempt={att})"
