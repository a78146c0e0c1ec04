"""Carrying out garbage collection (PROTOCOL.md §4.5): the plan comes from
:mod:`ckptstore.protocol.gcplan`; this module lists, verifies and deletes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import CorruptionError, LimitReachedError, NotFoundError
from ..protocol import component_key, run_prefix
from ..protocol.gcplan import plan_gc
from ..protocol.pieces import ListedPiece, plan_sweep
from ..protocol.records import IntentRecord
from ..protocol.selection import SaveInfo, SaveState
from .catalog import Catalog, Scan
from .pieces import IntentCache, PieceTiming, list_intents

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
    #: save-intent bytes the sweep read (each changed intent once; bounded by MAX_INTENT_BYTES a round)
    intent_bytes_read: int = 0
    #: rounds of the piece sweep (each lists the intents)
    sweep_rounds: int = 0


def collect(
    catalog: Catalog,
    *,
    keep_last: int,
    keep_every: int | None,
    grace_seconds: float,
    dry_run: bool,
    deep: bool,
    timing: PieceTiming | None = None,
) -> GcReport:
    io = catalog.io
    timing = timing or PieceTiming()
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
    if scan.pieces is not None:
        sweep_pieces(catalog, scan, [i for i, _ in plan.delete], report, grace_seconds, timing)
    return report


def _commit_marks(catalog: Catalog, scan: Scan, deleted: list[SaveInfo]) -> dict[tuple[str, str], int] | str:
    """Pieces named by every commit record gc did not delete; a reason instead
    when one of them cannot be read (its pieces are unknown: sweep nothing)."""
    gone = {(i.step, i.attempt) for i in deleted if i.state in (SaveState.COMMITTED, SaveState.SUPERSEDED)}
    marks: dict[tuple[str, str], int] = {}
    for sa, listed in sorted(scan.commits.items()):
        if sa in gone:
            continue
        try:
            rec = catalog.load_commit(sa[0], sa[1], listed, listed.key)
        except NotFoundError:
            continue  # removed since the listing: it names nothing any more
        except CorruptionError as exc:  # unreadable, or a newer version's: what it names is unknown
            return f"commit record of step {sa[0]}, attempt {sa[1]} cannot be read ({str(exc)[:200]})"
        marks.update(rec.piece_refs())
    return marks


def sweep_pieces(
    catalog: Catalog, scan: Scan, deleted: list[SaveInfo], report: GcReport, grace_seconds: float,
    timing: PieceTiming,
) -> None:
    """§9.5: mark from every kept commit and every live save intent, then
    delete the pieces of ``scan.pieces`` (listed before the commits) that
    nothing marks and that are older than the grace period, all within half
    the window after the intents were listed; past it, the next round lists the
    intents again (reading only the ones that changed). Bounded: at most
    :data:`MAX_INTENTS` intents and :data:`MAX_INTENT_BYTES` of them, at most
    :data:`MAX_IDLE_ROUNDS` rounds in a row that delete nothing, at most
    :data:`MAX_SWEEP_ROUNDS` in all; an intent dated implausibly (created later
    than gc's clock plus :data:`INTENT_CLOCK_SKEW`; one expiring before it was
    created does not decode) refuses the sweep. Every refusal or stop sets ``pieces_refused``."""
    io = catalog.io
    assert scan.pieces is not None
    marks = _commit_marks(catalog, scan, deleted)
    if isinstance(marks, str):
        report.pieces_refused = f"{marks}; no piece is swept while a commit record cannot be read"
        return
    commit_marks = marks
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
            expired = []
            for key, rec in sorted(intents.items()):
                refused = implausible_intent(key, rec, now, grace_seconds)
                if refused is not None:
                    report.pieces_refused = refused
                    return
                if now >= rec.expires_at:
                    expired.append(key)
                else:
                    marks.update(dict.fromkeys(rec.pieces, 0))
            plan = plan_sweep(todo if todo is not None else scan.pieces.values(), marks, now=scan.pieces_listed_at,
                              grace_seconds=grace_seconds)
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


def implausible_intent(key: str, rec: IntentRecord, now: float, grace_seconds: float) -> str | None:
    """Why gc must not sweep while intent ``rec`` exists (§9.5 step 4), or None:
    it lives longer than the grace period, or was created later than gc's clock plus :data:`INTENT_CLOCK_SKEW` (a writer's
    clock that far ahead, or a planted intent, would keep its pieces for ever)."""
    life = rec.expires_at - rec.created_at
    if life > grace_seconds:
        return (f"save intent {key} lives {life:.0f}s, longer than the grace period ({grace_seconds:.0f}s); no piece "
                "is swept (use a grace period at least as long as the intents')")
    if rec.created_at > now + INTENT_CLOCK_SKEW:
        return (f"save intent {key} was created {rec.created_at - now:.0f}s after gc's clock says it is now "
                f"(more than {INTENT_CLOCK_SKEW:.0f}s ahead); no piece is swept while it exists (fix the writer's "
                "clock, or remove the intent by hand if no live writer made it)")
    return None
