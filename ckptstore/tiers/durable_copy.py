"""Copying one local publication to the durable tier (PROTOCOL.md §4.8 item
2, §9.6): its components or pieces uploaded, each read once from the local
tier and verified on the way (:func:`upload_components`), the durable commit
of the same record bytes between the durable fences (:func:`commit_durable`),
both in order for one save (:func:`copy_save`), and the uploads that start
while a save is still being written locally (:class:`EarlyUploads`). The
thread that runs them in commit order is :mod:`.replicator`'s."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core.bounded_io import RunIO
from ..core.fencing import AttemptLog
from ..core.intents import PieceTiming
from ..core.piece_reads import check_pieces
from ..core.writer import WriterContext, commit_record
from ..errors import NotFoundError
from ..protocol import AttemptRecord, ComponentEntry, component_key, save_prefix
from ..protocol.layout import piece_key
from ..protocol.records import PieceRef
from ..protocol.selection import SaveRef
from .durable_intent import DurableIntent

#: Objects (components, pieces) one replication uploads at the same time.
UPLOAD_CONCURRENCY = 4


def _copy_object(local: RunIO, durable: RunIO, key: str, entry: ComponentEntry, label: str) -> None:
    """Stream one object from the local tier to the same key in the durable
    tier: one read of the local bytes, verified on the way (the last chunk is
    handed to the upload only after the whole object matched ``entry``, so a
    corrupt local copy makes the upload fail and nothing lands). A transient
    upload failure is retried with a fresh read."""
    durable.retry.call(lambda: durable.backend.put(key, local.verified_chunks(key, entry, label)))


def _piece_copy(run_id: str, name: str, p: PieceRef) -> tuple[str, ComponentEntry, str]:
    """What :func:`_copy_object` takes to copy piece ``p`` of component ``name``: its key (the same in
    both tiers), the entry it is verified against, and its label in messages."""
    return piece_key(run_id, p.holder, p.digest), p.as_entry(), f"local copy of {name!r}, piece {p.digest[:16]}"


def upload_components(local: RunIO, durable: RunIO, ref: SaveRef, names: Iterable[str] | None = None,
                      on_component: Callable[[str], None] | None = None, *,
                      have: Collection[tuple[str, str]] | None = None, uploaded: Collection[str] = ()) -> None:
    """Copy the components ``names`` of ``ref`` (default: all of them) from the
    local tier into the durable save folder, up to :data:`UPLOAD_CONCURRENCY`
    objects at once, every byte read once and verified against the manifest
    on the way (:class:`CorruptionError` when the local copy does not verify),
    then check that each landed intact in the durable listing
    (:class:`NotFoundError` otherwise). A pieced component (version 3) is
    copied as its pieces: only those not in ``have`` ((holder, digest) pairs
    the durable tier holds and a live intent protects; None: none) are
    uploaded, to the same piece keys, and every piece it names must then be
    listed with its size. ``uploaded``: names whose verified bytes are already
    in the durable tier (:class:`EarlyUploads`): only their landing is checked.
    ``on_component`` is called with each name once its bytes are all in, in
    name order. Creates no commit record: a multi-rank
    save has each rank upload its own names, and the coordinator commits."""
    rec = ref.record
    chosen = sorted(rec.components) if names is None else sorted(names)
    skip = set(have or ())
    jobs: list[tuple[str, list[tuple[str, ComponentEntry, str]]]] = []
    queued: set[tuple[str, str]] = set()
    for name in chosen:
        comp = rec.components[name]
        if comp.pieces is None:
            jobs.append((name, [] if name in uploaded else
                         [(component_key(local.run_id, rec.save_id, name), comp, f"local copy of {name!r}")]))
            continue
        objs: list[tuple[str, ComponentEntry, str]] = []
        for p in comp.pieces:
            hd = (p.holder, p.digest)
            if hd in skip or hd in queued:
                continue
            queued.add(hd)
            objs.append(_piece_copy(local.run_id, name, p))
        jobs.append((name, objs))
    flat = [o for _, objs in jobs for o in objs]
    if flat:
        pool = ThreadPoolExecutor(max(1, min(UPLOAD_CONCURRENCY, len(flat))), thread_name_prefix="ckptstore-repl")
        try:
            futures = {o[0]: pool.submit(_copy_object, local, durable, *o) for o in flat}
            for name, objs in jobs:
                for key, _, _ in objs:
                    futures[key].result()
                if on_component is not None:
                    on_component(name)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    elif on_component is not None:
        for name, _ in jobs:
            on_component(name)
    plain = [n for n in chosen if rec.components[n].pieces is None]
    if plain:
        prefix = save_prefix(durable.run_id, rec.save_id)
        listed = {o.key[len(prefix):]: o.size for o in durable.list(prefix)}
        for name in plain:
            if listed.get(name) != rec.components[name].size:
                raise NotFoundError(f"{durable.where(prefix + name)}: replicated component did not land intact")
    pieced = [rec.components[n] for n in chosen if rec.components[n].pieces is not None]
    problems = check_pieces(durable, pieced, None, deep=False)
    if problems:
        raise NotFoundError(f"{durable.where(save_prefix(durable.run_id, rec.save_id))}: {problems[0][1]} in the "
                            f"durable tier after replication" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def commit_durable(durable: RunIO, attempts: AttemptLog, ref: SaveRef, *, attempt: AttemptRecord | None = None
                   ) -> bool:
    """Create the durable commit record of ``ref`` (every component already
    uploaded and checked): the *same bytes* as the local one, by the one commit
    sequence (``core.writer.commit_record``) after the durable pre-commit
    fence. True when this call created it, False when it was already there
    with the same bytes (a retry after a lost reply); :class:`SupersededError`
    when the fences refuse it, :class:`CommitConflictError` when the durable
    tier holds another commit of the same step and attempt, and
    :class:`CommitUnknownError` when the outcome cannot be told (retried).
    Nothing uploaded is removed on a failure: other ranks' parts may be among
    it. ``attempt``: the save's attempt record when the caller already read it."""
    rec = ref.record
    if attempt is None:
        attempt = attempts.read(rec.attempt)
    attempts.check_not_superseded(attempt, rec.step, committed=False)
    ctx = WriterContext(durable, attempts, attempt, rec.writer_id, rec.identity_digest, attempts.auth)
    return commit_record(ctx, rec.step, rec.save_id, rec, {}, again_ok=True)


def copy_save(local: RunIO, durable: RunIO, attempts: AttemptLog, ref: SaveRef,
              on_component: Callable[[str], None] | None = None, *, timing: PieceTiming,
              intent: DurableIntent | None = None,
              early: EarlyStarted | None = None) -> bool:
    """Make ``ref`` (a local publication) durable: the pre-commit fence (a
    fenced writer uploads nothing), :func:`upload_components`, then
    :func:`commit_durable`. A version-3 save first has ``intent`` (the
    replicator's save intent in the durable tier; a fresh one, with the run's
    ``timing``, when None)
    protect the durable pieces it reuses, uploads only the pieces the durable
    tier lacks, and is committed only while that intent is live and after
    every piece it names was listed there. True when this call created the
    durable commit record, False when it was already there with the same
    bytes. Raises :class:`SupersededError` when the durable fences refuse it,
    :class:`CorruptionError` when the local copy does not verify,
    :class:`CommitConflictError` when the durable tier holds another commit
    of the same step and attempt, and the store's errors otherwise.
    ``early``: uploads started while the save was still being written
    locally (:class:`EarlyUploads`): whole components, or a version-3 save's
    own new pieces; those that succeeded with the committed entry (piece) are
    not uploaded again, and a version-3 replication counts its time from the
    first of them (the pieces' age, §9.4 step 1)."""
    rec = ref.record
    attempt = attempts.read(rec.attempt)
    attempts.check_not_superseded(attempt, rec.step, committed=False)
    if not rec.piece_refs():
        done: set[str] = set()
        for name, (entry, fut) in (early.components if early is not None else {}).items():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - uploaded again now, with its own errors
                continue
            if rec.components.get(name) == entry:
                done.add(name)
        upload_components(local, durable, ref, None, on_component, uploaded=done)
        return commit_durable(durable, attempts, ref, attempt=attempt)
    started = time.monotonic()
    need = rec.piece_refs()
    landed: set[tuple[str, str]] = set()  # this save's own pieces an early upload put in the durable tier
    if early is not None:
        started = min(started, early.started)
        for hd, (size, fut) in early.pieces.items():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - uploaded again now, with its own errors
                continue
            if hd[0] == rec.save_id and need.get(hd) == size:
                landed.add(hd)
    guard = intent if intent is not None else DurableIntent(durable, rec.attempt, timing)
    try:
        have = guard.protect(rec)
        # what landed early is checked like the rest: listed in the durable tier with its size
        upload_components(local, durable, ref, None, on_component, have=set(have) | landed)
        guard.check_live(rec, started)
        created = commit_durable(durable, attempts, ref, attempt=attempt)
    except BaseException:
        guard.forget()
        raise
    guard.learn(rec)  # the next replication skips these pieces; its intent is written now
    if intent is None:
        guard.close()
    return created


@dataclass
class EarlyStarted:
    """The early uploads of one save (:class:`EarlyUploads`)."""

    #: ``time.monotonic()`` when the first of them began
    started: float
    #: whole components (version 2): name -> (the entry uploaded, its upload)
    components: dict[str, tuple[ComponentEntry, Future[None]]] = field(default_factory=dict)
    #: the save's own new pieces (version 3): (holder, digest) -> (size, its upload)
    pieces: dict[tuple[str, str], tuple[int, Future[None]]] = field(default_factory=dict)


class EarlyUploads:
    """A save's bytes copied to the durable tier while the save is still being
    written locally: each component as soon as its local ``put`` returned (read
    back from the local tier and verified on the way, like every replicated
    byte) — a whole component (version 2), or the new pieces the save wrote
    under its own ID (version 3; pieces of earlier saves it reuses are left to
    :func:`copy_save`, which protects them with its durable intent) — so that a
    save is durable about one upload after its last component was written, not
    after the whole local save and then the whole upload. Never a commit
    record: the durable commit still comes from :func:`copy_save` after the
    local one, in commit order, between the durable fences, after every piece
    it names was listed there. Uploads of a save that is never replicated
    (aborted, skipped, fenced) are left to the durable tier's gc (uncommitted,
    older than the grace period; a version-3 replication counts its age from
    the first early upload, so none of its pieces can have aged past it)."""

    #: saves whose uploads are remembered at most (older ones are forgotten)
    KEEP = 4

    def __init__(self, local: RunIO, durable: RunIO) -> None:
        self.local, self.durable = local, durable
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._by_save: dict[str, EarlyStarted] = {}

    def start(self, save_id: str, entry: ComponentEntry) -> None:
        """Begin copying component ``entry`` of ``save_id``, written and settled
        locally (its bytes are verified against ``entry`` on the way): the
        whole component, or the pieces of it held under ``save_id``."""
        rid = self.local.run_id
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(UPLOAD_CONCURRENCY, thread_name_prefix="ckptstore-early")
            mine = self._by_save.get(save_id)
            if mine is None:
                mine = self._by_save[save_id] = EarlyStarted(time.monotonic())
            if entry.pieces is None:
                fut = self._pool.submit(_copy_object, self.local, self.durable, component_key(rid, save_id, entry.name),
                                        entry, f"local copy of {entry.name!r}")
                mine.components[entry.name] = (entry, fut)
            for p in entry.pieces or ():
                hd = (p.holder, p.digest)
                if p.holder != save_id or hd in mine.pieces:
                    continue
                fut = self._pool.submit(_copy_object, self.local, self.durable, *_piece_copy(rid, entry.name, p))
                mine.pieces[hd] = (p.size, fut)
            while len(self._by_save) > self.KEEP:
                self._by_save.pop(next(iter(self._by_save)))

    def take(self, save_id: str) -> EarlyStarted | None:
        """The uploads started for ``save_id`` (forgotten here), None when none was."""
        with self._lock:
            return self._by_save.pop(save_id, None)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            self._by_save.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
