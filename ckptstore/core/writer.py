"""Writing a save: *stage* (components hashed while written) and *publish*
(the commit, from inventories that may come from other processes).
PROTOCOL.md §4.3.

The two halves are separate so that a coordinator can publish what many
ranks staged: every rank stages its components under one save ID chosen by
the coordinator; the coordinator gathers the inventories and calls
:func:`publish` once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ..backends.base import PendingPut
from ..errors import (
    CommitConflictError,
    CommitUnknownError,
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    SaveAbortedError,
    StoreUnavailableError,
)
from ..protocol import (
    AttemptRecord,
    CommitRecord,
    ComponentEntry,
    component_key,
    now,
    parse_save_id,
    save_prefix,
    validate_component_name,
)
from ..protocol.layout import piece_key
from ..protocol.selection import SaveRef
from ..util.redact import redact_text
from .bounded_io import RunIO
from .fencing import AttemptLog
from .hashing import check_data
from .intents import PieceTiming
from .piece_deadlines import PieceDeadline, Publication, check_rank_anchors
from .piece_reads import check_pieces, check_present
from .pieces import SETTLE_BATCH, PieceWriter, SavePieces
from .record_auth import RecordAuth

#: components :meth:`StagedSave.put_many` writes at the same time
PUT_MANY_THREADS = 4


@dataclass(frozen=True)
class WriterContext:
    """What a writer of one attempt needs: its I/O, its attempt and fences."""

    io: RunIO
    attempts: AttemptLog
    attempt: AttemptRecord
    writer_id: str
    identity_digest: str
    auth: RecordAuth
    #: set in a run whose version stores pieces (§9): components are written as pieces
    pieces: PieceWriter | None = None


def check_save_id(ctx: WriterContext, step: int, save_id: str) -> str:
    """A caller-chosen save ID must name this step and this attempt."""
    if not isinstance(save_id, str) or parse_save_id(save_id) != (step, ctx.attempt.number):
        raise InvalidInputError(
            f"save ID {str(save_id)[:80]!r} does not name step {step} of attempt {ctx.attempt.number}; "
            "make one with store.new_save_id(step)"
        )
    return save_id


class StagedSave:
    """Components of one save being written; publishes nothing by itself.

    Use as a context manager: an exception inside the block aborts (removes
    what this object wrote). ``components`` is the inventory to publish.
    """

    def __init__(self, ctx: WriterContext, step: int, save_id: str) -> None:
        self.ctx = ctx
        self.step = step
        self.save_id = save_id
        self._components: dict[str, ComponentEntry] = {}
        self._lock = threading.Lock()
        self.closed = False
        #: the pieces side of this save (a version-3 run), made at the first ``put``
        self.pieces: SavePieces | None = None

    def _pieces(self) -> SavePieces | None:
        if self.ctx.pieces is None:
            return None
        with self._lock:
            if self.pieces is None:
                self.pieces = self.ctx.pieces.begin(self.step, self.save_id)
            return self.pieces

    def __enter__(self) -> StagedSave:
        return self

    def put(self, name: str, data: Any) -> ComponentEntry:
        """Write one component, hashing it with BLAKE3 while it is written.

        ``data``: bytes-like (bytes, bytearray, memoryview, numpy array, ...), a
        binary file object, or an iterable of bytes-like buffers.
        """
        if self.closed:
            raise InvalidInputError("this save is already closed")
        validate_component_name(name)
        check_data(data)
        with self._lock:
            if name in self._components:
                raise InvalidInputError(f"component {name!r} was already written in this save")
            for other in self._components:
                if other.startswith(name + "/") or name.startswith(other + "/"):
                    raise InvalidInputError(f"component {name!r} clashes with {other!r} (a name cannot be a folder)")
            self._components[name] = ComponentEntry(name, -1, "")  # reserve
        try:
            pieces = self._pieces()
            if pieces is not None:
                entry = pieces.put(name, data)
            else:
                size, digest = self.ctx.io.put_hashed(component_key(self.ctx.io.run_id, self.save_id, name), data)
                entry = ComponentEntry(name, size, digest)
        except BaseException:
            with self._lock:
                self._components.pop(name, None)
            raise
        with self._lock:
            self._components[name] = entry
        return entry

    def put_many(self, items: Sequence[tuple[str, Any]]) -> dict[str, ComponentEntry]:
        """Write several components at once (up to :data:`PUT_MANY_THREADS`
        concurrently, each hashed while written, as :meth:`put`) and make them
        durable together: each component's bytes are made durable as soon as
        it is written (``Backend.settle_data``), then one ``Backend.settle``
        renames each to its key and fsyncs each folder once (on the local
        disk: one directory fsync for the save's folder instead of one per
        component, PROTOCOL.md §7.2; past ``SETTLE_BATCH`` waiting objects,
        a batch is settled early). Returns
        the entries, by name, only once all are durable; on a failure the
        first error is raised (what landed is settled and stays in the
        inventory, for the caller's abort to remove)."""
        if self.closed:
            raise InvalidInputError("this save is already closed")
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"put_many: a component is named twice in {names[:10]}")
        for name, data in items:
            validate_component_name(name)
            check_data(data)
        with self._lock:
            for name in names:
                if name in self._components:
                    raise InvalidInputError(f"component {name!r} was already written in this save")
                for other in [*self._components, *names]:
                    if other != name and (other.startswith(name + "/") or name.startswith(other + "/")):
                        raise InvalidInputError(f"component {name!r} clashes with {other!r} (a name cannot be a folder)")
            for name in names:
                self._components[name] = ComponentEntry(name, -1, "")  # reserve
        landed: list[PendingPut] = []
        entries: dict[str, ComponentEntry] = {}
        lock = threading.Lock()

        def one(name: str, data: Any) -> None:
            pieces = self._pieces()
            mine: list[PendingPut] = []
            try:
                if pieces is not None:
                    entry = pieces.put(name, data, defer=mine)
                else:
                    key = component_key(self.ctx.io.run_id, self.save_id, name)
                    size, digest, pending = self.ctx.io.put_hashed_deferred(key, data)
                    mine.append(pending)
                    entry = ComponentEntry(name, size, digest)
                # this component's bytes durable now, while the others are still being written;
                # the renames and the folder's fsync wait for the settle of them all
                self.ctx.io.backend.settle_data(mine)
            finally:
                with lock:
                    landed.extend(mine)
            with lock:
                entries[name] = entry
            settle(force=False)

        def settle(force: bool) -> None:
            """Settle what landed: at the end, or once SETTLE_BATCH objects wait (bounded open files)."""
            with lock:
                if not force and len(landed) < SETTLE_BATCH:
                    return
                batch = list(landed)
                landed.clear()
            self.ctx.io.backend.settle(batch)

        failure: BaseException | None = None
        try:
            if len(items) <= 1:
                for name, data in items:
                    one(name, data)
            else:
                with ThreadPoolExecutor(min(PUT_MANY_THREADS, len(items)), thread_name_prefix="ckptstore-put") as pool:
                    futures = [pool.submit(one, name, data) for name, data in items]
                for f in futures:
                    if failure is None and f.exception() is not None:
                        failure = f.exception()
        except BaseException as exc:  # noqa: BLE001 - raised below, after what landed is settled
            failure = exc
        try:
            settle(force=True)  # every object durable at its key before any entry is returned
        except BaseException as exc:  # noqa: BLE001 - raised below
            failure = failure or exc
            entries.clear()  # none is known durable
        with self._lock:
            for name in names:
                if name in entries:
                    self._components[name] = entries[name]
                else:
                    self._components.pop(name, None)
        if failure is not None:
            raise failure
        return entries

    @property
    def components(self) -> dict[str, ComponentEntry]:
        """The inventory so far (a component still being written has size -1)."""
        with self._lock:
            return dict(self._components)

    def abort(self) -> None:
        """Close and remove what this object wrote (best effort; gc removes
        what a killed process left). Pieces stay: they are addressed by
        content, a retry of the same step reuses those that verify, and gc
        sweeps the others once older than its grace period (§9)."""
        self.closed = True
        remove_components(self.ctx.io, self.save_id, self.components)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None and not self.closed:
            self.abort()


def remove_components(io: RunIO, save_id: str, names: Mapping[str, object] | Sequence[str], *,
                      own_pieces: bool = False) -> None:
    """Remove what a save that will never be published wrote (best effort; gc
    removes leftovers). A pieced component has no object of its own: with
    ``own_pieces`` (the save's step and attempt are committed by another save,
    or the store is full) the pieces it holds under its own ID go too; else
    they stay for a retry of the step to reuse (§9.2 "Skipping"). No save of
    this attempt relies on them (``PieceWriter._left_by_step`` takes earlier
    attempts' only)."""
    doomed: set[str] = set()
    for name in list(names):
        if isinstance(names, Mapping) and isinstance(c := names[name], ComponentEntry) and c.pieces is not None:
            if own_pieces:
                doomed |= {p.digest for p in c.pieces if p.holder == save_id}
            continue
        try:
            io.backend.delete(component_key(io.run_id, save_id, name))
        except Exception:  # noqa: BLE001 - best effort; gc removes leftovers
            pass
    for digest in sorted(doomed):
        try:
            io.backend.delete(piece_key(io.run_id, save_id, digest))
        except Exception:  # noqa: BLE001 - best effort; gc removes leftovers
            pass


def _verify_inventory(ctx: WriterContext, step: int, save_id: str, comps: Mapping[str, ComponentEntry]) -> None:
    """Every component is there with the size its writer recorded (read-after-write)."""
    io = ctx.io
    comps = {n: c for n, c in comps.items() if c.pieces is None}  # pieces: checked by check_pieces
    if not comps:
        return
    prefix = save_prefix(io.run_id, save_id)
    if io.backend.capabilities.consistent_list:
        listed = {o.key[len(prefix) :]: o.size for o in io.list(prefix)}
    else:  # a listing may lag behind writes: ask for each object instead
        listed = {}
        for n in comps:
            try:
                listed[n] = io.size(prefix + n)
            except FileNotFoundError:
                continue
    for n, c in comps.items():
        size = listed.get(n)
        if size is None or size != c.size:
            raise SaveAbortedError(
                f"save of step {step}: component {n!r} did not land intact "
                f"({'missing' if size is None else f'{size} bytes, wrote {c.size}'}); nothing was published"
            )


def _settle_failed_commit(
    ctx: WriterContext, key: str, data: bytes, save_id: str, comps: Mapping[str, ComponentEntry], exc: Exception
) -> None:
    try:
        there = ctx.io.get_bounded(key, len(data))
    except NotFoundError:
        remove_components(ctx.io, save_id, comps, own_pieces=True)  # nothing published; the caller re-raises
        return
    except StoreUnavailableError as again:
        raise CommitUnknownError(
            f"{ctx.io.where(key)}: the commit record's create failed ({redact_text(str(exc))}) and it cannot be "
            f"read back ({redact_text(str(again))}); treat the save as not acknowledged"
        ) from exc
    if there == data:
        raise CommitUnknownError(
            f"{ctx.io.where(key)}: the commit record landed but its create reported a failure "
            f"({redact_text(str(exc))}); treat the save as not acknowledged — latest_complete() tells whether "
            "it is selectable"
        ) from exc


def _check(
    ctx: WriterContext, step: int, save_id: str, comps: dict[str, ComponentEntry],
    ranks: Mapping[int, Sequence[str]] | None, expect: Sequence[str], pieces: SavePieces | None,
    pub: Publication | None = None, rank_pieces: Mapping[int, PieceDeadline] | None = None,
) -> dict[int, tuple[str, ...]] | None:
    """Publish, step 1 (§4.3 steps 4-5): the inventory is complete and landed
    (pieces included, §9.4; ``pub``: whether the save may rely on its anchor,
    ``PieceWriter.publishing``; ``rank_pieces``: the other ranks' parts, whose
    anchors are checked against it), and no later attempt forked before this
    step. Returns the rank map. Before raising, what was written is removed."""
    check_save_id(ctx, step, save_id)
    pending = [n for n, c in comps.items() if c.size < 0]
    if pending:
        raise SaveAbortedError(f"components still being written at commit: {pending}")
    missing = [n for n in expect if n not in comps]
    if missing:
        remove_components(ctx.io, save_id, comps)
        raise SaveAbortedError(
            f"save of step {step} is incomplete: expected component(s) {missing} were never written; "
            "nothing was published"
        )
    if not comps:
        raise SaveAbortedError(f"save of step {step} has no components; nothing was published")
    rank_map: dict[int, tuple[str, ...]] | None = None
    if ranks is not None:
        rank_map = {int(r): tuple(names) for r, names in ranks.items()}
        named = [n for names in rank_map.values() for n in names]
        if sorted(named) != sorted(comps):
            raise InvalidInputError("ranks must name every component exactly once")
    pieced = any(c.pieces is not None for c in comps.values())
    if pieced and not ctx.io.layout.pieces:
        raise InvalidInputError(f"run {ctx.io.run_id!r} is protocol version {ctx.io.layout.version}: its saves "
                                "cannot name pieces (version 3 and later)")
    try:
        if rank_pieces:
            check_rank_anchors(rank_pieces, pub.anchor_key if pub is not None else None, ctx.pieces.timing
                               if ctx.pieces is not None else PieceTiming(), save_id)
        if pieces is not None:
            pieces.check_before_publish(comps, anchored=pub is not None and pub.anchored)
        elif pieced:
            problems = check_pieces(ctx.io, comps.values(), None, deep=False)
            if problems:
                raise SaveAbortedError(f"save of step {step}: {problems[0][1]}; nothing was published")
        _verify_inventory(ctx, step, save_id, comps)
        ctx.attempts.check_not_superseded(ctx.attempt, step, committed=False)
    except BaseException:
        remove_components(ctx.io, save_id, comps)  # nothing was published: remove what was written
        raise
    return rank_map


def _seal(
    ctx: WriterContext, step: int, save_id: str, comps: dict[str, ComponentEntry], metadata: Mapping[str, Any] | None,
    rank_map: dict[int, tuple[str, ...]] | None, world_size: int | None,
) -> CommitRecord:
    """Publish, step 2: the commit record, tagged when a key is configured."""
    return ctx.auth.seal(CommitRecord(
        run_id=ctx.io.run_id,
        step=step,
        attempt=ctx.attempt.number,
        save_id=save_id,
        writer_id=ctx.writer_id,
        identity_digest=ctx.identity_digest,
        components=comps,
        created_at=now(),
        metadata=dict(metadata or {}),
        ranks=rank_map,
        world_size=world_size,
        version=ctx.io.layout.version,
    ), ctx.io.run_id)


def _create(
    ctx: WriterContext, step: int, save_id: str, record: CommitRecord, comps: Mapping[str, ComponentEntry],
    again_ok: bool,
) -> bool:
    """Publish, step 3 (§4.3 step 6): create-if-absent of the commit record.
    A :class:`CommitUnknownError` passes through with the components kept
    (the record may have landed). ``again_ok``: a record already there with
    exactly these bytes is this save's own (False), not a conflict."""
    key = ctx.io.layout.commit_key(ctx.io.run_id, step, ctx.attempt.number)
    data = record.encode()
    try:
        created = ctx.io.create(key, data, what="commit record")
    except StoreUnavailableError as exc:
        # A definite failure (e.g. no space left for the record). If the record is
        # not there, nothing was published: remove the save's bytes now instead of
        # leaving them on a full disk until gc, and re-raise the failure. If it is
        # there (the failure came after it landed), the outcome is unknown
        # (CommitUnknownError) and nothing is removed.
        _settle_failed_commit(ctx, key, data, save_id, comps, exc)
        raise
    if not created:
        if again_ok and ctx.io.get_bounded(key, len(data) + 1) == data:
            return False
        remove_components(ctx.io, save_id, comps, own_pieces=True)  # the step is another save's for good
        raise CommitConflictError(
            f"{ctx.io.where(key)}: step {step} was already committed by another writer of "
            f"attempt {ctx.attempt.number}; this save ({save_id}) was not published"
        )
    return True


def _post_fence(ctx: WriterContext, step: int) -> None:
    """Publish, step 4 (§4.3 step 7): no later attempt fenced this save off.
    :class:`SupersededError` passes through; a fence that cannot be read
    makes the outcome unknown."""
    try:
        ctx.attempts.check_not_superseded(ctx.attempt, step, committed=True)
    except (StoreUnavailableError, CorruptionError) as exc:
        # The record landed, but whether a newer attempt fenced us off cannot be told.
        raise CommitUnknownError(
            f"run {ctx.io.run_id!r}: the commit record of step {step} landed, but the post-commit fence "
            f"check failed ({redact_text(str(exc))}); treat the save as not acknowledged — latest_complete() tells whether "
            "it is selectable"
        ) from exc


def commit_record(
    ctx: WriterContext, step: int, save_id: str, record: CommitRecord, comps: Mapping[str, ComponentEntry],
    *, again_ok: bool = False,
) -> bool:
    """The one commit sequence (§4.3 steps 6-7) of every publication in every
    tier — a save, a rank's part, a replication — after the caller's pre-commit
    fence (run with its inventory check, step 5): the record's canonical bytes
    created if absent (a lost reply is settled by reading them back,
    ``RunIO.create``), then the post-commit fence. ``comps``: what this call
    may remove when nothing was published (a replication passes none: other
    ranks uploaded them). ``again_ok``: a record already there with the same
    bytes is this save's own earlier try (a replication retried): False. True
    when this call created the record. Raises a :class:`SaveNotPublishedError`
    subclass."""
    created = _create(ctx, step, save_id, record, comps, again_ok)
    _post_fence(ctx, step)
    return created


def publish(
    ctx: WriterContext,
    step: int,
    save_id: str,
    components: Mapping[str, ComponentEntry],
    *,
    metadata: Mapping[str, Any] | None = None,
    ranks: Mapping[int, Sequence[str]] | None = None,
    world_size: int | None = None,
    expect: Sequence[str] = (),
    pieces: SavePieces | None = None,
    rank_pieces: Mapping[int, PieceDeadline] | None = None,
) -> SaveRef:
    """Publish a staged save (§4.3 steps 4-7): check (inventory, pieces,
    pre-commit fence), seal the record, create it if absent, post-commit fence.
    ``rank_pieces``: a coordinator's, the other ranks' piece deadlines (their
    anchors checked in the same critical section as the commit, §9.4).

    Every failure raises a :class:`SaveNotPublishedError` subclass. Before the
    commit, the staged components are removed; after an unknown outcome
    (:class:`CommitUnknownError`) nothing is removed. ``pieces``: the save's
    pieces side, when it was staged in this process (its intent is checked).
    """
    comps = dict(components)
    if pieces is None and ctx.pieces is not None:
        pieces = ctx.pieces.active(save_id)
    with _publishing(ctx, pieces) as pub:
        rank_map = _check(ctx, step, save_id, comps, ranks, expect, pieces, pub, rank_pieces)
        record = _seal(ctx, step, save_id, comps, metadata, rank_map, world_size)
        commit_record(ctx, step, save_id, record, comps)
    if ctx.pieces is not None:
        ctx.pieces.learn(record)  # the next save skips these pieces; their intent is written now
    return SaveRef.of(record)


def seal_record(
    ctx: WriterContext, step: int, save_id: str, components: Mapping[str, ComponentEntry], *,
    metadata: Mapping[str, Any] | None, ranks: Mapping[int, Sequence[str]], world_size: int | None,
) -> CommitRecord:
    """The commit record of a multi-rank save whose ranks write into separate
    local tiers (PROTOCOL.md §"Tiers"): sealed here once, then published by
    every rank for its own part with :func:`publish_part` (the same bytes in
    every tier). Checks the rank map names every component exactly once and
    that every component is finished; a pieced component (version 3) is
    allowed only in a run that stores pieces (each rank checks its own part's
    pieces at :func:`publish_part`, the coordinator cannot see the others')."""
    check_save_id(ctx, step, save_id)
    comps = dict(components)
    if not comps:
        raise SaveAbortedError(f"save of step {step} has no components; nothing was published")
    rank_map = {int(r): tuple(names) for r, names in ranks.items()}
    if sorted(n for names in rank_map.values() for n in names) != sorted(comps):
        raise InvalidInputError("ranks must name every component exactly once")
    if any(c.size < 0 for c in comps.values()):
        raise InvalidInputError("a multi-rank tiered save cannot hold unfinished components")
    if any(c.pieces is not None for c in comps.values()) and not ctx.io.layout.pieces:
        raise InvalidInputError(f"run {ctx.io.run_id!r} is protocol version {ctx.io.layout.version}: its saves "
                                "cannot name pieces (version 3 and later)")
    return _seal(ctx, step, save_id, comps, metadata, rank_map, world_size)


def publish_part(ctx: WriterContext, record: CommitRecord, names: Sequence[str]) -> SaveRef:
    """Publish ``record`` (sealed by the coordinator) in this rank's tier,
    holding only the components ``names`` (this rank's part): they are listed
    with their recorded sizes, the pre-commit fence, the record's bytes
    created if absent, the post-commit fence. A pieced part (version 3) is
    checked as one process's save is (§9.4): with the rank's staged pieces
    (``ctx.pieces``) steps 1-2 for its part again, then every piece of the
    part present in this tier with its size (step 3). The record must be of
    this context's attempt. Raises a :class:`SaveNotPublishedError` subclass."""
    step, save_id = record.step, record.save_id
    check_save_id(ctx, step, save_id)
    if record.attempt != ctx.attempt.number or record.run_id != ctx.io.run_id:
        raise InvalidInputError(f"the record of step {step} is not of attempt {ctx.attempt.number} of this run")
    unknown = [n for n in names if n not in record.components]
    if unknown:
        raise SaveAbortedError(f"save of step {step}: component(s) {unknown[:5]} are not in the record; not published")
    mine = {n: record.components[n] for n in names}
    staged = ctx.pieces.active(save_id) if ctx.pieces is not None else None
    with _publishing(ctx, staged) as pub:
        try:
            if staged is not None:
                staged.check_before_publish(mine, anchored=pub.anchored)
            elif any(c.pieces is not None for c in mine.values()):
                check_present(ctx.io, mine, save_id)
            _verify_inventory(ctx, step, save_id, mine)
            ctx.attempts.check_not_superseded(ctx.attempt, step, committed=False)
        except BaseException:
            remove_components(ctx.io, save_id, mine)
            raise
        commit_record(ctx, step, save_id, record, mine)
    return SaveRef.of(record)


def _publishing(ctx: WriterContext, pieces: SavePieces | None) -> AbstractContextManager[Publication]:
    """A publication's checks and commit, one at a time per piece writer (version 3:
    ``PieceWriter.publishing``, which also says whether the save may rely on its anchor)."""
    return ctx.pieces.publishing(pieces) if ctx.pieces is not None else nullcontext(Publication(False, None))


class SaveWriter:
    """One save in progress, published when its ``with`` block exits cleanly.
    Created by ``CheckpointStore.save``: a :class:`StagedSave` plus a publish."""

    def __init__(self, staged: StagedSave, publish_staged: Callable[[Mapping[str, ComponentEntry]], SaveRef]) -> None:
        self.staged = staged
        self.step = staged.step
        self.save_id = staged.save_id
        self._publish = publish_staged
        #: The published save, set when the ``with`` block exits cleanly.
        self.ref: SaveRef | None = None

    def __enter__(self) -> SaveWriter:
        return self

    def put(self, name: str, data: Any) -> ComponentEntry:
        """Write one component, hashing it with BLAKE3 while it is written (see :meth:`StagedSave.put`)."""
        return self.staged.put(name, data)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> dict[str, ComponentEntry]:
        """Write several components, made durable together (see :meth:`StagedSave.put_many`)."""
        return self.staged.put_many(items)

    @property
    def components(self) -> dict[str, ComponentEntry]:
        return self.staged.components

    def commit(self) -> SaveRef:
        """Verify the inventory and publish. Called by a clean ``with`` exit."""
        if self.staged.closed:
            raise InvalidInputError("this save is already closed")
        self.staged.closed = True
        self.ref = self._publish(self.staged.components)
        return self.ref

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            if not self.staged.closed:
                self.staged.abort()
            return
        self.commit()
