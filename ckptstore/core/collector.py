"""Carrying out garbage collection (PROTOCOL.md §4.5): the plan comes from
:mod:`ckptstore.protocol.gcplan`; this module lists, verifies and deletes."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from ..backends.base import ObjectInfo
from ..errors import CorruptionError, LimitReachedError, NotFoundError
from ..protocol import component_key, is_component_name, run_prefix, save_prefix
from ..protocol.gcplan import plan_gc
from ..protocol.layout import piece_key
from ..protocol.pieces import ListedPiece, plan_sweep
from ..protocol.records import IntentRecord
from ..protocol.selection import SaveInfo, SaveState
from .bounded_io import RunIO
from .catalog import Catalog, Scan, commit_info, uncommitted_info
from .commit_names import CommitKeys
from .fencing import AttemptView
from .intents import IntentCache, PieceTiming, list_intents

#: Rounds of one piece sweep at most (each lists the save intents again, §9.5).
MAX_SWEEP_ROUNDS = 100
#: Rounds in a row that delete nothing before the sweep stops (and says why).
MAX_IDLE_ROUNDS = 3
#: How far ahead of gc's clock an intent's ``created_at`` may be (clock skew).
INTENT_CLOCK_SKEW = 300.0


@dataclass
class GcAction:
    key: str
    reason: str


@dataclass
class GcReport:
    dry_run: bool
    kept: list[str]
    deleted_saves: list[tuple[str, str]]
    actions: list[GcAction]
    #: what killed writers left behind (local temporary files, unfinished
    #: multipart uploads), older than the grace period
    temporaries: list[str] = field(default_factory=list)
    #: set when gc refused to delete anything, and why
    refused: str | None = None
    #: component bytes gc read to verify what it keeps
    bytes_read: int = 0
    #: keys under ``saves/`` that are not ckptstore's (``..`` segments, names
    #: that are not component names, save IDs of another spelling): left alone
    ignored: list[str] = field(default_factory=list)
    #: version 3 (§9.5): pieces deleted (or, dry run, that would be) and their bytes
    pieces_freed: int = 0
    piece_bytes_freed: int = 0
    #: pieces kept because a kept commit or a live save intent names them, and
    #: unmarked ones kept because they are younger than the grace period
    pieces_marked: int = 0
    pieces_young: int = 0
    #: expired save intents removed (a killed writer's)
    intents_expired: list[str] = field(default_factory=list)
    #: set when gc swept no piece (or stopped before the end of the sweep), and why (the saves were still collected)
    pieces_refused: str | None = None
    #: set when gc swept only the pieces of committed saves (an intent outlives the grace period), and why
    pieces_deferred: str | None = None
    #: save-intent bytes the sweep read (each changed intent once; bounded by MAX_INTENT_BYTES a round)
    intent_bytes_read: int = 0
    #: rounds of the piece sweep (each lists the intents)
    sweep_rounds: int = 0
    #: ``gc(incremental=True)`` judged only what is new and what it deletes (§4.5.1); False: a full gc ran
    incremental: bool = False


def collect(
    catalog: Catalog,
    *,
    keep_last: int,
    keep_every: int | None,
    grace_seconds: float,
    dry_run: bool,
    deep: bool,
    timing: PieceTiming | None = None,
    retention: Retention | None = None,
) -> GcReport:
    """A full gc (§4.5): one listing of the run, every commit judged.
    ``retention``: remember what it judged and left there (its next
    :meth:`Retention.run` starts from it)."""
    io = catalog.io
    timing = timing or PieceTiming()
    taken_at = time.time()
    scan = catalog.scan(clock=timing.clock)
    if scan.attempts.unreadable:
        # An attempt record we cannot read might fence saves we would call
        # superseded (or be a planted one that we must not act on): delete nothing.
        n = min(scan.attempts.unreadable)
        return GcReport(
            dry_run, [], [], [], [],
            refused=f"attempt record {n} cannot be read ({scan.attempts.unreadable[n][:200]}); "
            "gc deletes nothing while an unreadable attempt record exists (inspect and remove it by hand)",
            ignored=scan.foreign,
        )
    # Deep-check newest first only until ``keep_last`` saves verified: what is
    # older is deleted (or kept by keep_every) on the size check, so gc reads
    # what it keeps, not the whole store.
    start = io.bytes_read
    infos = catalog.list_saves(scan, deep, grace_seconds, deep_until=keep_last)
    plan = plan_gc(infos, keep_last=keep_last, keep_every=keep_every)
    actions: list[GcAction] = []
    for info, reason in plan.delete:
        # the commit record goes first: a crash in between leaves a partial save, never a dangling commit
        if info.state in (SaveState.COMMITTED, SaveState.SUPERSEDED):
            actions.append(GcAction(catalog.commit_key(info.step, info.attempt), reason))
        for name in sorted(scan.save_objects.get(info.save_id, {})):
            actions.append(GcAction(component_key(io.run_id, info.save_id, name), reason))
    incomplete = io.backend.list_incomplete(run_prefix(io.run_id), time.time() - grace_seconds)
    if not dry_run:
        for act in actions:
            io.delete(act.key)
        for handle in incomplete:
            io.backend.remove_incomplete(handle)
    report = GcReport(
        dry_run, [i.save_id for i in plan.keep], [(i.save_id, r) for i, r in plan.delete], actions, incomplete,
        bytes_read=io.bytes_read - start, ignored=scan.foreign,
    )
    named: tuple[dict[str, Marks], set[str]] | None = ({}, set())
    if scan.pieces is not None:
        named = sweep_pieces(catalog, scan, [i for i, _ in plan.delete], report, grace_seconds, timing,
                             kept=evidence(plan.keep))
        if report.pieces_deferred or report.pieces_refused:
            # an uncommitted save of pieces alone whose pieces were not judged was not deleted: say so
            spared = {i.save_id for i, _ in plan.delete if i.state is SaveState.PARTIAL
                      and not scan.save_objects.get(i.save_id)}
            report.deleted_saves = [(s, r) for s, r in report.deleted_saves if s not in spared]
            report.kept += sorted(spared)
    if retention is not None:
        gone = {(i.step, i.attempt) for i, _ in plan.delete}
        retention.remember(
            (keep_last, keep_every, grace_seconds, deep), taken_at, scan.attempts, plan.keep,
            set(scan.commits) - gone if not dry_run and not scan.other else None,
            named if report.pieces_refused is None else None,
        )
    return report


Marks = dict[tuple[str, str], int]


def evidence(kept: list[SaveInfo]) -> set[str]:
    """Save IDs gc keeps as evidence for an operator (corrupt or of a newer version: §4.5): their pieces
    are kept whatever a record names and whatever their age (a save whose commit record names another
    save ID comes back whole when an operator repairs the record)."""
    return {i.save_id for i in kept if i.state in (SaveState.CORRUPT, SaveState.UNSUPPORTED)}


def _commit_marks(catalog: Catalog, scan: Scan, deleted: list[SaveInfo]
                  ) -> tuple[Marks, set[str], dict[str, Marks]] | str:
    """Pieces named by every commit record gc did not delete, the save IDs of
    every commit record gc read (those it deleted included: §9.5 step 5's
    settled holders), and what each remaining record names by its save ID (a
    retention view's, :class:`Retention`); a reason instead when a remaining
    record cannot be read (its pieces are unknown: sweep nothing)."""
    committed = (SaveState.COMMITTED, SaveState.SUPERSEDED)
    gone = {(i.step, i.attempt) for i in deleted if i.state in committed}
    settled = {i.save_id for i in deleted if i.state in committed}
    marks: Marks = {}
    per_save: dict[str, Marks] = {}
    for sa, listed in sorted(scan.commits.items()):
        if sa in gone:
            continue
        try:
            rec = catalog.load_commit(sa[0], sa[1], listed, listed.key)
        except NotFoundError:
            continue  # removed since the listing: it names nothing any more
        except CorruptionError as exc:  # unreadable, or a newer version's: what it names is unknown
            return f"commit record of step {sa[0]}, attempt {sa[1]} cannot be read ({str(exc)[:200]})"
        named = rec.piece_refs()
        marks.update(named)
        settled.add(rec.save_id)
        per_save[rec.save_id] = named
    return marks, settled, per_save


def sweep_pieces(
    catalog: Catalog, scan: Scan, deleted: list[SaveInfo], report: GcReport, grace_seconds: float,
    timing: PieceTiming, kept: Collection[str] = (),
) -> tuple[dict[str, Marks], set[str]] | None:
    """§9.5 over the whole run: mark from every kept commit (each record read)
    and every live save intent, then delete the pieces of ``scan.pieces``
    (listed before the commits) that nothing marks and that are older than the
    grace period or whose holder's commit gc read (settled: step 5), by
    :func:`sweep_rounds`. Returns what each kept commit names and the settled
    holders (None when a record could not be read: nothing was swept)."""
    assert scan.pieces is not None
    read = _commit_marks(catalog, scan, deleted)
    if isinstance(read, str):
        report.pieces_refused = f"{read}; no piece is swept while a commit record cannot be read"
        return None
    commit_marks, settled, per_save = read
    sweep_rounds(catalog.io, list(scan.pieces.values()), commit_marks, settled, scan.pieces_listed_at, report,
                 grace_seconds, timing, protected=kept)
    return per_save, settled


def sweep_rounds(
    io: RunIO, candidates: list[ListedPiece], commit_marks: Marks, settled: Collection[str], listed_at_wall: float,
    report: GcReport, grace_seconds: float, timing: PieceTiming, protected: Collection[str] = (),
) -> None:
    """§9.5 steps 4-5, the one copy: in rounds, list the intents (live ones
    mark what they name), then delete the ``candidates`` that nothing marks
    and that are older than the grace period by ``listed_at_wall`` or whose
    holder is ``settled``, all within half the window after the intents were
    listed; past it, the next round lists the intents again (reading only the
    ones that changed). Bounded: at most :data:`MAX_INTENTS` intents and
    :data:`MAX_INTENT_BYTES` of them, at most :data:`MAX_IDLE_ROUNDS` rounds in a
    row that delete nothing, at most :data:`MAX_SWEEP_ROUNDS` in all; an intent
    dated implausibly (created later than gc's clock plus
    :data:`INTENT_CLOCK_SKEW`; one expiring before it was created does not
    decode) refuses the sweep. Every refusal or stop sets ``pieces_refused``.
    While an intent lives longer than the grace period, only settled holders'
    pieces go (``pieces_deferred`` says why). ``protected``: save IDs gc keeps
    as evidence (:func:`evidence`): their pieces are never deleted."""
    keep = set(protected)
    protected_pieces = [(p.holder, p.digest) for p in candidates if p.holder in keep]
    todo: list[ListedPiece] | None = None
    expired: list[str] = []
    cache = IntentCache()
    idle = 0
    try:
        for _round in range(MAX_SWEEP_ROUNDS):
            report.sweep_rounds += 1
            # one round: list the intents, then delete only within half the window after that listing
            listed_at = time.monotonic()
            try:
                intents, unreadable = list_intents(io, cache)
            except LimitReachedError as exc:
                report.pieces_refused = f"{exc}; no piece is swept"
                return
            if unreadable:
                report.pieces_refused = f"save intent {unreadable[0]}; no piece is swept while an intent cannot be read"
                return
            now = timing.clock()
            marks = dict(commit_marks)
            marks.update(dict.fromkeys(protected_pieces, 0))
            expired = []
            by_age = grace_seconds
            for key, rec in sorted(intents.items()):
                refused = implausible_intent(key, rec, now, grace_seconds)
                if refused is not None:
                    report.pieces_refused = refused
                    return
                longer = outlives_grace(key, rec, grace_seconds)
                if longer is not None:  # only settled holders' pieces may go (they do not depend on age)
                    report.pieces_deferred, by_age = longer, float("inf")
                if now >= rec.expires_at:
                    expired.append(key)
                else:
                    marks.update(dict.fromkeys(rec.pieces, 0))
            plan = plan_sweep(todo if todo is not None else candidates, marks, now=listed_at_wall,
                              grace_seconds=by_age, settled=settled)
            if todo is None:
                report.pieces_marked, report.pieces_young = plan.marked, plan.young
            todo = []
            deadline = listed_at + timing.window / 2
            freed = 0
            for i, p in enumerate(plan.delete):
                if not report.dry_run:
                    if time.monotonic() >= deadline:
                        todo = plan.delete[i:]  # the next round lists the intents again first
                        break
                    io.delete(p.key)
                freed += 1
                report.pieces_freed += 1
                report.piece_bytes_freed += p.size
            if not todo:
                break
            idle = idle + 1 if freed == 0 else 0
            if idle >= MAX_IDLE_ROUNDS:
                report.pieces_refused = (
                    f"the sweep stopped after {MAX_IDLE_ROUNDS} rounds in a row that deleted nothing (listing and "
                    f"reading the save intents took longer than half the {timing.window:g}s window); "
                    f"{len(todo)} piece(s) left for the next gc (remove stray intents, or use a longer window)")
                return
        else:
            report.pieces_refused = f"the sweep stopped after {MAX_SWEEP_ROUNDS} rounds; {len(todo or [])} piece(s) left"
    finally:
        report.intent_bytes_read += cache.bytes_read
    report.intents_expired = expired
    if not report.dry_run:
        for key in expired:
            io.delete(key)


def outlives_grace(key: str, rec: IntentRecord, grace_seconds: float) -> str | None:
    """Why gc may not judge pieces by age while intent ``rec`` exists (§9.5
    step 4), or None: it lives longer than the grace period, so a save it
    belongs to may run longer than that and its new pieces be older than the
    grace. Pieces of settled holders do not depend on age (§9.5 step 5)."""
    life = rec.expires_at - rec.created_at
    if life > grace_seconds:
        return (f"save intent {key} lives {life:.0f}s, longer than the grace period ({grace_seconds:.0f}s): pieces "
                "of saves that never committed were not judged (use a grace period at least as long as the intents')")
    return None


def implausible_intent(key: str, rec: IntentRecord, now: float, grace_seconds: float) -> str | None:
    """Why gc must not sweep at all while intent ``rec`` exists (§9.5 step 4), or
    None: it was created later than gc's clock plus :data:`INTENT_CLOCK_SKEW` (a
    writer's clock that far ahead, or a planted intent, would keep its pieces
    for ever). ``grace_seconds`` is not used (see :func:`outlives_grace`)."""
    if rec.created_at > now + INTENT_CLOCK_SKEW:
        return (f"save intent {key} was created {rec.created_at - now:.0f}s after gc's clock says it is now "
                f"(more than {INTENT_CLOCK_SKEW:.0f}s ahead); no piece is swept while it exists (fix the writer's "
                "clock, or remove the intent by hand if no live writer made it)")
    return None


#: Commits newer than the remembered view that one incremental retention judges at most (more: a full gc).
MAX_NEW_COMMITS = 64


def attempts_seen(view: AttemptView) -> tuple[object, ...]:
    """What of an attempt listing decides gc: the numbers of the records (each
    immutable, read once), the unreadable ones and the junk count."""
    return (tuple(sorted(view.records)), tuple(sorted(view.unreadable.items())), view.junk)


class Retention:
    """Retention after each save whose cost follows what it deletes, not the
    history (PROTOCOL.md §4.5.1): a full gc remembers what it judged and left
    (the kept rows, the commit keys it listed, the attempts); each later call
    judges only the commits newer than that view (one listing page), the
    ``keep_last`` newest complete saves again (deep when asked, like a full
    gc), the view's uncommitted saves (one listing of each), and every save it
    is about to delete (its record and a listing of its save), then deletes
    with gc's plan (:func:`~ckptstore.protocol.gcplan.plan_gc`) over the view
    merged with what it judged. Version 3 (pieces): the view also holds what
    each of its commits names (read by the full gc's sweep), so the pieces that
    only the deleted commits named, under settled holders, are swept by the
    one sweep (:func:`sweep_rounds`: the intents listed, deletes within half
    the window) without listing the run's pieces; what else a full sweep would
    take (pieces of uncommitted saves past the grace period) waits for the
    next full gc. Whenever anything it judged again disagrees with the view,
    the attempts changed, the run is of version 1, the view does not know what
    its commits name, the parameters changed, or the view is older than the
    grace period, it runs a full gc instead (and remembers that)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._lock = threading.Lock()
        self._params: tuple[object, ...] | None = None
        self._taken_at = 0.0
        self._attempts: tuple[object, ...] = ()
        #: the rows a later save can change: uncommitted saves, and commits not yet settled (below)
        self._infos: dict[str, SaveInfo] = {}
        #: save IDs of the settled rows: corrupt and unsupported commits (kept as evidence) and commits
        #: kept by ``keep_every`` behind the ``keep_last`` newest (kept whatever is saved later); never deleted
        self._settled: set[str] = set()
        self._commits: set[tuple[int, int]] | None = None
        #: the rows of ``_infos`` that judge a commit (the others: save folders)
        self._from_commit: set[str] = set()
        #: why the last :meth:`run` was a full gc ("" when it was incremental)
        self.last_full = ""
        #: version 3: what each commit row of the view names ((holder, digest) -> size), by save ID;
        #: None: not known (a record the full gc could not read): every retention is a full gc
        self._named: dict[str, Marks] | None = None
        #: version 3: save IDs of commits the view saw and that are gone since (settled holders, §9.5 step 5)
        self._gone: set[str] = set()

    def remember(self, params: tuple[object, ...], taken_at: float, attempts: AttemptView, kept: list[SaveInfo],
                 commits: set[tuple[int, int]] | None,
                 named: tuple[dict[str, Marks], set[str]] | None = ({}, set())) -> None:
        """What a full gc judged and left (``commits`` None: nothing to start from;
        ``named``: what each remaining commit names and the settled holders, None when unknown)."""
        self._params, self._taken_at, self._attempts = params, taken_at, attempts_seen(attempts)
        self._settled = set()
        self._keep(kept, {self._row_key(i) for i in kept if i.created_at is not None}, params)
        self._commits = commits
        self._named = dict(named[0]) if named is not None else None
        self._gone = (named[1] - set(named[0])) if named is not None else set()

    def _keep(self, kept: list[SaveInfo], from_commit: set[str], params: tuple[object, ...]) -> None:
        """Split the kept rows into the live ones and the settled ones."""
        keep_last, keep_every = params[0], params[1]
        assert isinstance(keep_last, int)
        live: dict[str, SaveInfo] = {}
        complete = 0
        for i in sorted(kept, key=lambda i: (i.step, i.attempt), reverse=True):
            k = self._row_key(i)
            committed = i.state is SaveState.COMMITTED
            complete += committed
            settled = k in from_commit and (
                i.state in (SaveState.CORRUPT, SaveState.UNSUPPORTED)
                or (committed and complete > keep_last and isinstance(keep_every, int) and i.step % keep_every == 0)
            )
            if settled:
                self._settled.add(i.save_id)
            else:
                live[k] = i
        self._infos = live
        self._from_commit = from_commit & set(live)

    @staticmethod
    def _row_key(i: SaveInfo) -> str:
        return f"{i.step:012d}-{i.attempt:08d}/{i.save_id}"

    def forget(self) -> None:
        self._commits = None
        self._named = None

    def run(self, *, keep_last: int, keep_every: int | None, grace_seconds: float, dry_run: bool, deep: bool,
            timing: PieceTiming | None = None) -> GcReport:
        with self._lock:
            params = (keep_last, keep_every, grace_seconds, deep)
            why = self._why_full(params)
            if not why:
                got = self._incremental(keep_last, keep_every, grace_seconds, dry_run, deep, timing or PieceTiming())
                if isinstance(got, GcReport):
                    self.last_full = ""
                    return got
                why = got
            self.last_full = why
            self.forget()
            return collect(self.catalog, keep_last=keep_last, keep_every=keep_every, grace_seconds=grace_seconds,
                           dry_run=dry_run, deep=deep, timing=timing, retention=None if dry_run else self)

    def _why_full(self, params: tuple[object, ...]) -> str:
        layout = self.catalog.io.layout
        if self._commits is None:
            return "no view of the run yet"
        if not layout.newest_first:
            return f"protocol version {layout.version}: every retention is a full gc"
        if layout.pieces and self._named is None:
            return "what the kept saves name is not known (a commit record could not be read)"
        if params != self._params:
            return "other retention parameters than the view's"
        if time.time() >= self._taken_at + float(params[2]):  # type: ignore[arg-type]
            return "the view is older than the grace period"
        return ""

    def _incremental(self, keep_last: int, keep_every: int | None, grace_seconds: float, dry_run: bool,
                     deep: bool, timing: PieceTiming) -> GcReport | str:
        """The report, or why a full gc must decide instead (nothing was deleted)."""
        cat, io = self.catalog, self.catalog.io
        assert self._commits is not None
        attempts = cat.attempts.load()
        if attempts_seen(attempts) != self._attempts:
            return "the run's attempts changed"
        keys = CommitKeys(io)
        new: list[tuple[int, int]] = []
        for sa in keys.newest_first():
            if sa in self._commits:
                break
            new.append(sa)
            if len(new) > MAX_NEW_COMMITS:
                return f"more than {MAX_NEW_COMMITS} commits since the view"
        if keys.other:
            return "names of another version's commit naming"
        infos = dict(self._infos)
        from_commit = set(self._from_commit)
        objects: dict[str, dict[str, ObjectInfo]] = {}
        fresh: set[str] = set()

        pieced = io.layout.pieces
        named = dict(self._named or {})

        def judge(sa: tuple[int, int], want_deep: bool) -> SaveInfo:
            c, objs = cat.judge_one(sa[0], sa[1], None, attempts, want_deep)
            info = commit_info(c, objs, want_deep, None, False)
            objects[info.save_id] = objs
            fresh.add(self._row_key(info))
            return info

        for sa in new:
            info = judge(sa, False)
            if pieced:  # what the new commit names (its record, read again only when it did not verify)
                try:
                    rec = info.ref.record if info.ref is not None else cat.load_commit(sa[0], sa[1])
                except (CorruptionError, NotFoundError):
                    return f"the commit record of step {sa[0]}, attempt {sa[1]} cannot be read"
                named[rec.save_id] = rec.piece_refs()
            for k in [k for k, i in infos.items() if i.save_id == info.save_id]:
                del infos[k]  # its uncommitted row: committed since
            infos[self._row_key(info)] = info
            from_commit.add(self._row_key(info))
        now = time.time()
        for k, i in list(infos.items()):
            if i.ref is None and i.state in (SaveState.IN_PROGRESS, SaveState.PARTIAL):
                sa = (i.step, i.attempt)
                prefix = save_prefix(io.run_id, i.save_id)
                objs = {o.key[len(prefix) :]: o for o in io.list(prefix) if is_component_name(o.key[len(prefix) :])}
                if sa in new:
                    return "an uncommitted save of the view has a commit that names another save"
                if not objs:
                    del infos[k]  # removed since the view
                    continue
                infos[k] = uncommitted_info(i.save_id, sa, objs, [], now, grace_seconds, attempts)
                objects[i.save_id] = objs
                fresh.add(k)
        # the keep_last newest complete saves, judged again as a full gc judges them (deep first)
        verified = 0
        for k in sorted(infos, reverse=True):
            i = infos[k]
            if verified >= keep_last:
                break
            if k not in from_commit or i.state not in (SaveState.COMMITTED, SaveState.CORRUPT):
                continue
            again = judge((i.step, i.attempt), deep) if deep or k not in fresh else i
            if again.state is not i.state or again.save_id != i.save_id:
                return f"save {i.save_id} is {again.state.value} now, {i.state.value} in the view"
            infos[k] = again
            verified += again.state is SaveState.COMMITTED
        plan = plan_gc(list(infos.values()), keep_last=keep_last, keep_every=keep_every)
        plan.delete = [(i, r) for i, r in plan.delete if i.save_id not in self._settled]
        for i, _ in plan.delete:
            k = self._row_key(i)
            if k in fresh:
                continue
            again = judge((i.step, i.attempt), False)
            if again.state is not i.state or again.save_id != i.save_id:
                return f"save {i.save_id} is {again.state.value} now, {i.state.value} in the view"
        committed = (SaveState.COMMITTED, SaveState.SUPERSEDED)
        deleted_ids = {i.save_id for i, _ in plan.delete if i.state in committed}
        if pieced and not deleted_ids <= set(named):
            return "what a save to delete names is not known"
        actions: list[GcAction] = []
        for info, reason in plan.delete:
            if info.state in committed:
                actions.append(GcAction(cat.commit_key(info.step, info.attempt), reason))
            for name in sorted(objects.get(info.save_id, {})):
                actions.append(GcAction(component_key(io.run_id, info.save_id, name), reason))
        if not dry_run:
            for act in actions:
                io.delete(act.key)
        report = GcReport(dry_run, [i.save_id for i in plan.keep], [(i.save_id, r) for i, r in plan.delete], actions,
                          incremental=True)  # kept: the rows it judged (the settled ones are kept as they were)
        if pieced:
            self._sweep_deleted(named, deleted_ids, report, grace_seconds, timing,
                                evidence(plan.keep) | self._settled)
        if not dry_run:
            gone = {(i.step, i.attempt) for i, _ in plan.delete}
            self._commits = (self._commits | set(new)) - gone
            self._keep(plan.keep, from_commit, (keep_last, keep_every))
            if pieced:
                self._gone |= deleted_ids
                self._named = {sid: n for sid, n in named.items() if sid not in deleted_ids}
        return report

    def _sweep_deleted(self, named: dict[str, Marks], deleted: set[str], report: GcReport, grace_seconds: float,
                       timing: PieceTiming, kept: set[str]) -> None:
        """Version 3: the pieces only the ``deleted`` commits named, under settled holders (a commit the
        view saw), swept by the one sweep; the remaining commits' pieces are its marks."""
        io = self.catalog.io
        remaining: Marks = {}
        for sid, n in named.items():
            if sid not in deleted:
                remaining.update(n)
        settled = set(named) | self._gone
        seen: set[tuple[str, str]] = set()
        candidates: list[ListedPiece] = []
        for sid in sorted(deleted):
            for (h, d), size in named[sid].items():
                if (h, d) in remaining or (h, d) in seen or h not in settled:
                    continue  # kept by a remaining commit, or not settled: the next full gc judges it by age
                seen.add((h, d))
                candidates.append(ListedPiece(piece_key(io.run_id, h, d), h, d, size, 0.0))
        if candidates:
            sweep_rounds(io, candidates, remaining, settled, timing.clock(), report, grace_seconds, timing,
                         protected=kept)
