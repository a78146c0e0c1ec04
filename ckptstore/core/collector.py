"""Carrying out garbage collection (PROTOCOL.md §4.5): the plan comes from
:mod:`ckptstore.protocol.gcplan`; this module lists, verifies and deletes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..protocol import component_key, run_prefix
from ..protocol.gcplan import plan_gc
from ..protocol.selection import SaveState
from .catalog import Catalog


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


def collect(
    catalog: Catalog,
    *,
    keep_last: int,
    keep_every: int | None,
    grace_seconds: float,
    dry_run: bool,
    deep: bool,
) -> GcReport:
    io = catalog.io
    scan = catalog.scan()
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
    return GcReport(
        dry_run, [i.save_id for i in plan.keep], [(i.save_id, r) for i, r in plan.delete], actions, incomplete,
        bytes_read=io.bytes_read - start, ignored=scan.foreign,
    )
