"""Two tiers on many ranks (PROTOCOL.md §"Tiers", ``docs/tiers.md`` "Many ranks").

Folder rule: rank ``r`` of a job keeps its local tier in ``<local_tier>/rank-<r>``
(:func:`rank_root`), so two ranks of one node never share a directory or a
commit. Every rank's local commit record is the same bytes as the durable one
(sealed once by the coordinator); a rank's local tier holds only its *part*,
the components the record's ``ranks`` map gives it, and its selection checks
and verifies only those (:attr:`ckptstore.core.catalog.Catalog.part`).

* :func:`local_holdings`: what a rank reports to the coordinator before the
  job's attempt is registered — the newest local commits whose part verifies
  (every byte re-hashed); the coordinator resumes from the local tiers only
  when every rank holds the chosen save's exact record (manifest digest).
* :class:`PartCopier`: the replication step of one rank: upload its own
  components (:func:`~ckptstore.tiers.durable_copy.upload_components`); on the
  coordinator, then wait until the durable tier holds every component of the
  record with its size (the save folder's listing; for a pieced component,
  every piece listed with its size), and create the durable commit
  (:func:`~ckptstore.tiers.durable_copy.commit_durable`). A rank that never
  uploads never leads to a durable commit.
* Version 3 (pieces): each rank's :class:`~ckptstore.tiers.durable_intent.DurableIntent`
  protects the durable pieces its part reuses while it uploads only those
  the durable tier lacks; the coordinator's intent names every piece of the
  record and is at least ``window`` old before its presence check, and is
  still live at the commit (PROTOCOL.md §9.4, §9.6).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.binding import read_run_record
from ..core.bounded_io import RunIO
from ..core.catalog import Catalog, part_names
from ..core.commit_names import CommitKeys
from ..core.fencing import AttemptLog
from ..core.intents import PieceTiming
from ..core.piece_evidence import list_holders
from ..core.piece_reads import check_pieces
from ..core.record_auth import RecordAuth
from ..errors import CkptStoreError, TransientError
from ..protocol import CommitRecord, save_prefix
from ..protocol.selection import SaveRef, superseded_by
from .durable_copy import commit_durable, upload_components
from .durable_intent import DurableIntent
from .tier_dir import check_run_folder, open_tier_dir, rank_folder

#: the newest local commits a rank reports as verified (each costs a re-hash of its part at open)
MAX_HOLDINGS = 2
#: local commit records looked at, at most, to find them
MAX_LOOKED_AT = 16
#: seconds the coordinator's replicator waits for the other ranks' parts in one try
PART_WAIT_SECONDS = 2.0
_POLL = 0.05


class PartsMissingError(TransientError):
    """The durable save folder does not yet list every rank's components (retried)."""


def rank_root(local_tier: str | os.PathLike[str], rank: int) -> Path:
    """The local tier directory of rank ``rank`` under the job's ``local_tier``
    (for messages and tests: the tier opens it only below ``local_tier``,
    without following a link, :func:`~ckptstore.tiers.tier_dir.open_tier_dir`)."""
    return Path(local_tier) / rank_folder(rank)


def part_record(rec: CommitRecord, rank: int | None) -> CommitRecord:
    """``rec`` holding only rank ``rank``'s part (all of it when ``rank`` is
    None or the record has no rank map): what a rank's piece writers learn
    (its tiers hold the pieces of its part only). For memory only: its bytes
    are not the record's."""
    mine = part_names(rec, rank)
    if mine is None:
        return rec
    return replace(rec, components={n: c for n, c in rec.components.items() if n in mine})


def local_holdings(local_tier: str | os.PathLike[str], run_id: str, rank: int, identity_digest: str,
                   auth: RecordAuth, limit: int = MAX_HOLDINGS, *, folder: str | None = None
                   ) -> tuple[list[dict[str, Any]], list[str]]:
    """The newest (at most ``limit``) commits of ``run_id`` in rank ``rank``'s
    local tier (``<local_tier>/rank-<r>``, opened without following links)
    whose part for ``rank`` verifies (sizes and BLAKE3), as
    ``{"step", "attempt", "save_id", "manifest_digest"}``, and the reasons the
    others looked at did not. Reads only the local directory; never raises for
    a bad or missing local tier (an empty answer: a link at the rank folder or
    at the run's folder holds nothing). ``folder``: another folder below
    ``local_tier`` holding rank ``rank``'s parts (a peer copy, ``tiers.peers``)."""
    held: list[dict[str, Any]] = []
    reasons: list[str] = []
    path = Path(local_tier, *folder.split("/")) if folder else rank_root(local_tier, rank)
    try:
        backend = open_tier_dir(local_tier, rank, create=False, folder=folder)
        if backend is not None:
            check_run_folder(backend, run_id)
    except CkptStoreError as exc:
        return held, [f"rank {rank}: {exc}"[:300]]
    if backend is None or not backend.ops.is_dir(os.path.join(backend.root, run_id)):
        if backend is not None:
            backend.close()
        return held, [f"rank {rank}: no local tier of this run at {path}"]
    try:
        io = RunIO(backend, run_id, None)
        read_run_record(io, None)  # the local copy of the durable run record: the layout of its names
        log = AttemptLog(io, auth)
        catalog = Catalog(io, log, identity_digest)
        catalog.part = rank
        mirrored = log.load().effective  # the folder's copies of the durable attempt records
        for looked, (step, attempt) in enumerate(CommitKeys(io).newest_first()):
            if looked >= MAX_LOOKED_AT or len(held) >= limit:
                break
            later = superseded_by(step, attempt, mirrored)
            if later is not None:  # a zombie's save (the coordinator judges again by the durable records)
                reasons.append(f"rank {rank}: step {step} attempt {attempt}: superseded by attempt {later.number}")
                continue
            try:
                rec = catalog.load_commit(step, attempt)
                if rec.identity_digest != identity_digest:
                    reasons.append(f"rank {rank}: step {step} attempt {attempt}: another identity's commit")
                    continue
                if not part_names(rec, rank) and rec.ranks is not None:
                    reasons.append(f"rank {rank}: step {step} attempt {attempt}: the record gives this rank no part")
                    continue
                problems = catalog.check_components(rec, None, True)
            except (CkptStoreError, OSError) as exc:
                reasons.append(f"rank {rank}: step {step} attempt {attempt}: {exc}"[:300])
                continue
            if problems:
                reasons.append(f"rank {rank}: step {step} attempt {attempt}: {problems[0][1]}"[:300])
                continue
            held.append({"step": step, "attempt": attempt, "save_id": rec.save_id,
                         "manifest_digest": rec.manifest_digest()})
    except (CkptStoreError, OSError, ValueError) as exc:
        reasons.append(f"rank {rank}: local tier unreadable: {exc}"[:300])
    finally:
        backend.close()
    return held, reasons


class PartCopier:
    """The replication step of one rank of a multi-rank tiered job (see the
    module docstring); a drop-in for :func:`~ckptstore.tiers.durable_copy.copy_save`.
    Returns True when this call created the durable commit record.

    ``intent`` (version 3): this rank's save intent in the durable tier; a
    fresh one with the run's ``timing`` when None."""

    def __init__(self, rank: int, *, timing: PieceTiming, intent: DurableIntent | None = None,
                 wait_seconds: float = PART_WAIT_SECONDS) -> None:
        self.rank = rank
        self.wait_seconds = wait_seconds
        self.timing = timing
        self.intent = intent
        self._uploaded: set[str] = set()  # save IDs whose part this process uploaded and checked

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def __call__(self, local: RunIO, durable: RunIO, attempts: AttemptLog, ref: SaveRef,
                 on_component: Callable[[str], None] | None = None) -> bool:
        rec = ref.record
        attempts.check_not_superseded(attempts.read(rec.attempt), rec.step, committed=False)  # a zombie uploads nothing
        if rec.piece_refs():
            return self.copy_pieced(local, durable, attempts, ref, on_component)
        mine = part_names(rec, self.rank)
        if rec.save_id not in self._uploaded:
            upload_components(local, durable, ref, sorted(mine) if mine is not None else None, on_component)
            self._uploaded.add(rec.save_id)
            while len(self._uploaded) > 64:
                self._uploaded.pop()
        if not self.is_coordinator:
            return False  # the coordinator's replicator commits once every part is in
        self.wait_for_parts(durable, ref)
        created = commit_durable(durable, attempts, ref)
        self._uploaded.discard(rec.save_id)
        return created

    def copy_pieced(self, local: RunIO, durable: RunIO, attempts: AttemptLog, ref: SaveRef,
                    on_component: Callable[[str], None] | None) -> bool:
        """A version-3 save (§9.6 on many ranks): this rank's intent protects
        the durable pieces its part skips (on the coordinator: names every
        piece of the record, ``window`` old before the presence check); only
        the pieces of its part the durable tier lacks are uploaded, every one
        then listed with its size. A member stops there (its standing intent
        now names its part). The coordinator then waits until every component
        of the record is in the durable tier (:meth:`wait_for_parts`), checks
        its intent is still live and the replication ran shorter than an
        intent lives less the window, and commits. Any failure: nothing
        committed, the next try writes a fresh intent and lists again."""
        rec = ref.record
        mine = part_names(rec, self.rank)
        own = part_record(rec, self.rank)
        guard = self.intent if self.intent is not None else DurableIntent(durable, rec.attempt, self.timing)
        started = time.monotonic()
        try:
            have = guard.protect(rec if self.is_coordinator else own, every=self.is_coordinator)
            upload_components(local, durable, ref, sorted(mine) if mine is not None else None, on_component,
                              have=have)
            if not self.is_coordinator:
                guard.check_live(own, started)
                created = False
            else:
                self.wait_for_parts(durable, ref)
                guard.check_live(rec, started)
                created = commit_durable(durable, attempts, ref)
        except BaseException:
            guard.forget()
            raise
        guard.learn(rec if self.is_coordinator else own)  # the next replication skips these pieces
        if self.intent is None:
            guard.close()
        return created

    def wait_for_parts(self, durable: RunIO, ref: SaveRef) -> None:
        """Until every component of ``ref`` is in the durable tier with its
        recorded size: listed in the durable save folder, or, pieced, every
        piece listed with its size (one listing per holder)
        (:class:`PartsMissingError` after ``wait_seconds``; the replicator
        retries it with its backoff and skip rules)."""
        rec = ref.record
        prefix = save_prefix(durable.run_id, rec.save_id)
        plain = {n: c for n, c in rec.components.items() if c.pieces is None}
        pieced = [c for c in rec.components.values() if c.pieces is not None]
        holders = sorted({p.holder for c in pieced for p in c.pieces or ()})
        end = time.monotonic() + self.wait_seconds
        while True:
            listed = {o.key[len(prefix):]: o.size for o in durable.list(prefix)} if plain else {}
            missing = sorted(n for n, c in plain.items() if listed.get(n) != c.size)
            there = list_holders(durable, holders)
            lacking = {c.name for c in pieced if check_pieces(durable, [c], there, deep=False)}
            missing = sorted(set(missing) | lacking)
            if not missing:
                return
            if time.monotonic() >= end:
                owners = sorted({r for r, names in (rec.ranks or {}).items() if set(names) & set(missing)})
                raise PartsMissingError(
                    f"step {rec.step}: {len(missing)} component(s) of rank(s) {owners} not yet in the durable tier "
                    f"(e.g. {missing[0]!r}); no durable commit until every rank's part is in")
            time.sleep(_POLL)
