"""The local tier of a tiered store: a directory on this machine's disk that
holds publications of the run's saves (same save ID, same commit record
bytes, so the same manifest digest) with the local backend's own atomic
commit. ``docs/tiers.md`` and PROTOCOL.md §"Tiers" describe the rules.

The durable store is the one source of truth for identity, attempts and
fencing. The local tier keeps byte copies of the durable ``RUN.json`` and
attempt records (so the local writer's fences and a ``ckptstore ls`` of the
directory work without the network), but selection from the local tier is
always judged against the *durable* attempt records: a local copy of a zombie
attempt's save is superseded there exactly as in the durable tier.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..core.bounded_io import RunIO
from ..core.catalog import Catalog, Scan
from ..core.collector import GcReport, collect
from ..core.fencing import AttemptLog, AttemptView
from ..core.intents import PieceTiming
from ..core.pieces import PieceWriter
from ..core.record_auth import RecordAuth
from ..core.writer import WriterContext
from ..errors import CkptStoreError, CorruptionError, NotFoundError, StoreUnavailableError
from ..protocol import AttemptRecord, attempt_key, run_record_key
from ..protocol.selection import SaveRef, Selection
from ..retry import RetryPolicy
from .tier_dir import QUARANTINE, check_apart, check_run_folder, open_tier_dir, quarantine_run_folder, rank_folder

#: Bytes read at most from a run record (PROTOCOL.md §2 cap).
MAX_RUN_RECORD = 1 << 20

__all__ = ["MAX_RUN_RECORD", "QUARANTINE", "LocalTier", "MirroredAttempts"]


class MirroredAttempts(AttemptLog):
    """The local tier's copies of the attempt records, as the local writer's
    fences and the local gc see them. The durable tier is the one source of
    attempts: a local record counts only when the durable tier holds the same
    record (the same bytes). One the durable tier never had (planted, or left
    by another store) is ignored — it fences nothing and stops no gc — and
    reported once through ``on_ignored``. While the durable tier cannot be
    read, an unconfirmed local record counts (the fence holds: fail closed)."""

    def __init__(self, io: RunIO, auth: RecordAuth, durable: AttemptLog) -> None:
        super().__init__(io, auth)
        self.durable = durable
        #: number -> the canonical bytes of the durable record (confirmed)
        self.confirmed: dict[int, bytes] = {}
        #: number -> why the local record is ignored
        self.ignored: dict[int, str] = {}
        #: called once per newly ignored number with (number, why)
        self.on_ignored: Callable[[int, str], None] | None = None

    def confirm(self, rec: AttemptRecord) -> None:
        """``rec`` is a durable attempt record (read from the durable tier)."""
        self.confirmed[rec.number] = rec.encode()

    def _ignore(self, n: int, why: str) -> None:
        if n not in self.ignored:
            self.ignored[n] = why
            if self.on_ignored is not None:
                self.on_ignored(n, why)

    def _counts(self, n: int, rec: AttemptRecord) -> bool:
        data = rec.encode()
        if self.confirmed.get(n) == data:
            return True
        if n in self.ignored:
            return False
        try:
            durable = self.durable.read(n)
        except NotFoundError:
            self._ignore(n, "the durable tier has no attempt record of that number")
            return False
        except CorruptionError as exc:
            self._ignore(n, f"the durable record of that number is unusable ({str(exc)[:200]})")
            return False
        except CkptStoreError:
            return True  # the durable tier cannot tell now: the fence holds
        if durable.encode() != data:
            self._ignore(n, "it differs from the durable record of that number")
            return False
        self.confirmed[n] = data
        return True

    def load(self) -> AttemptView:
        """The local attempt records the durable tier confirms (see the class
        docstring); a local record that cannot be read is ignored and reported
        too (the durable tier's own unreadable records are never mirrored)."""
        view = super().load()
        for n, why in sorted(view.unreadable.items()):
            self._ignore(n, f"unreadable ({why[:200]})")
        return AttemptView({n: r for n, r in view.records.items() if self._counts(n, r)}, {}, view.junk)


class LocalTier:
    """One run's local tier: its I/O, a mirror of the durable attempt records,
    a catalog judged by the durable attempts (selection) and one judged by the
    local mirror (local gc, which never needs the durable tier).

    ``root`` is the operator's tier root, opened as given; with ``part`` (a
    rank of a job) the tier is the folder ``<root>/rank-<part>``. That folder,
    the run's folder and ``.quarantine`` are created and opened without
    following links, and a tier whose run folder is (or lies inside, or holds)
    the durable run's folder (``durable_url``, a ``file://`` store) is refused
    (:mod:`.tier_dir`, :class:`~ckptstore.errors.LocalTierRefusedError`)."""

    def __init__(
        self, root: str | os.PathLike[str], run_id: str, durable_attempts: AttemptLog, identity_digest: str,
        auth: RecordAuth, retry: RetryPolicy | None, part: int | None = None, durable_url: str = "",
        folder: str | None = None,
    ) -> None:
        #: the rank whose part this tier holds (a multi-rank job, ``tiers.parts``); None: whole saves
        self.part = part
        # in this order: a link at the rank folder and a tier inside the durable run are refused
        # before anything is created; then the tier folder is made (no link followed) and judged again.
        # ``folder``: another folder below ``root`` holding rank ``part``'s parts (a peer copy, ``tiers.peers``)
        existing = open_tier_dir(root, part, create=False, folder=folder)
        if existing is not None:
            existing.close()
        where = os.path.join(root, *(folder or rank_folder(part)).split("/")) if part is not None else root
        check_apart(where, run_id, durable_url, part is not None)
        backend = open_tier_dir(root, part, folder=folder)
        assert backend is not None
        self.backend = backend
        self.root = Path(backend.root)
        try:
            check_run_folder(backend, run_id)
            check_apart(backend.root, run_id, durable_url, part is not None)
        except BaseException:
            backend.close()
            raise
        self.io = RunIO(self.backend, run_id, retry)
        self.run_id = run_id
        self.durable_attempts = durable_attempts
        self.identity_digest = identity_digest
        self.auth = auth
        self.attempts = MirroredAttempts(self.io, auth, durable_attempts)
        #: selection: local saves judged by the durable attempt records
        self.catalog = self._catalog(durable_attempts)
        #: local gc: local saves judged by the local mirror only
        self.own_catalog = self._catalog(self.attempts)
        #: why the local tier was set aside at open (None when it was usable)
        self.quarantined: str | None = None
        #: where it was moved (None when nothing was moved)
        self.quarantined_to: str | None = None

    # ---------------------------------------------------------------- mirror
    def _quarantine(self, why: str) -> None:
        """Move this run's local folder aside (never deleted: evidence) and start empty."""
        self.quarantined_to = quarantine_run_folder(self.backend, self.run_id) or self.quarantined_to
        self.quarantined = why
        old = self.attempts
        self.attempts = MirroredAttempts(self.io, self.auth, self.durable_attempts)
        self.attempts.confirmed.update(old.confirmed)
        self.attempts.on_ignored = old.on_ignored
        self.own_catalog = self._catalog(self.attempts)
        self.catalog = self._catalog(self.durable_attempts)

    def _catalog(self, attempts: AttemptLog) -> Catalog:
        cat = Catalog(self.io, attempts, self.identity_digest)
        cat.part = self.part
        return cat

    def _copy(self, key: str, data: bytes, what: str) -> bool:
        """Create ``key`` locally with ``data``; False when a different object is already there."""
        if self.io.create(key, data, what=what):
            return True
        try:
            return self.io.get_bounded(key, len(data) + 1) == data
        except NotFoundError:
            return self.io.create(key, data, what=what)

    def mirror(self, run_record: bytes, view: AttemptView) -> None:
        """Copy the durable run record and attempt records into the local tier.
        A local tier whose copies differ (another run's, another machine's
        with the same run ID) is quarantined first and the copy made afresh.
        A local attempt record the durable tier never had is ignored and
        reported (:class:`MirroredAttempts`; its numbers in :attr:`ignored_attempts`)."""
        for rec in view.records.values():
            self.attempts.confirm(rec)
        for _ in range(2):
            ok = self._copy(run_record_key(self.run_id), run_record, "run record copy")
            bad = None if ok else "its RUN.json is not the durable run's (another run's local tier)"
            if bad is None:
                for n, rec in sorted(view.records.items()):
                    if not self._copy(attempt_key(self.run_id, n), rec.encode(), "attempt record copy"):
                        bad = f"its attempt record {n} differs from the durable one (another run's or machine's tier)"
                        break
            if bad is None:
                self.attempts.load()  # a local-only record is noticed (and reported) now, not at the first save
                return
            self._quarantine(bad)
        raise StoreUnavailableError(f"local tier {self.root}: cannot mirror the run's records ({bad})")

    @property
    def ignored_attempts(self) -> dict[int, str]:
        """Local attempt records ignored so far: number -> why."""
        return dict(self.attempts.ignored)

    def add_attempt(self, rec: AttemptRecord) -> None:
        """Mirror one newly registered attempt record."""
        self.attempts.confirm(rec)
        if not self._copy(attempt_key(self.run_id, rec.number), rec.encode(), "attempt record copy"):
            self._quarantine(f"its attempt record {rec.number} differs from the durable one")
            self._copy(attempt_key(self.run_id, rec.number), rec.encode(), "attempt record copy")

    def writer(self, attempt: AttemptRecord, writer_id: str, pieces: PieceWriter | None = None) -> WriterContext:
        """The context of a local publication (fences against the local mirror;
        ``pieces``: a version-3 run's local piece writer)."""
        return WriterContext(self.io, self.attempts, attempt, writer_id, self.identity_digest, self.auth, pieces)

    # ------------------------------------------------------------- selection
    def select(self, deep: bool, view: AttemptView | None, durable: SaveRef | None, *, own: bool = False
               ) -> tuple[SaveRef | None, list[str]]:
        """The newest local save that may be used, with the reasons any newer
        local candidate was not: selection by the durable attempt records
        (``view``), then two checks that only a local copy needs — its writer
        is the writer that registered its attempt in the durable tier, and a
        commit of the same step and attempt in the durable tier has the same
        manifest digest. Either failing sets the whole local tier aside
        (a planted or copied-in tier). Never raises for a bad local tier.
        ``own``: judged by the local mirror of the attempts (the durable tier
        is unavailable; never used for a resume point)."""
        reasons: list[str] = []
        log = self.attempts if own else self.durable_attempts
        try:
            sel = (self.own_catalog if own else self.catalog).select(deep, view, explain=False)
        except CkptStoreError as exc:
            return None, [f"local tier unreadable: {exc}"[:500]]
        reasons += [f"step {k.step} attempt {k.attempt}: {k.reason.value}: {k.detail}"[:300] for k in sel.skipped]
        ref = sel.latest
        if ref is None:
            return None, reasons
        try:
            registered = (view or log.load()).records.get(ref.attempt)
        except CkptStoreError as exc:
            return None, [*reasons, f"durable attempts unreadable: {exc}"[:500]]
        if registered is None or registered.writer_id != ref.record.writer_id:
            reasons.append(f"step {ref.step}: written by writer {ref.record.writer_id[:16]}, not the writer that "
                           f"registered attempt {ref.attempt} in the durable tier (a foreign local tier)")
            return None, reasons
        if durable is not None and (durable.step, durable.attempt) == (ref.step, ref.attempt) \
                and durable.manifest_digest != ref.manifest_digest:
            reasons.append(f"step {ref.step}: manifest digest differs from the durable commit's (a foreign copy)")
            return None, reasons
        return replace(ref, tier="local"), reasons

    def candidate(self, step: int, attempt: int, view: AttemptView, deep: bool) -> SaveRef | None:
        """The local commit ``(step, attempt)`` when :meth:`select` would accept
        it (judged by the durable attempt records ``view``, its part verified,
        written by the writer that registered its attempt), else None. For a
        resume point older than the newest local one (many ranks: the newest
        every rank holds)."""
        try:
            c = self.catalog.evaluate(step, attempt, Scan({}, {}, view, saves_listed=False), deep)
        except CkptStoreError:
            return None
        registered = view.records.get(attempt)
        if c.ref is None or registered is None or registered.writer_id != c.ref.record.writer_id:
            return None
        return replace(c.ref, tier="local")

    def explain(self, durable: Selection, chosen: SaveRef | None, reasons: list[str]) -> Selection:
        notes = (*durable.notes, *(f"local tier: {r}" for r in reasons[:20]))
        return Selection(chosen, durable.skipped, durable.more_skipped, notes, durable.unusable)

    def has_verified(self, ref: SaveRef) -> bool:
        """Whether this tier holds ``ref``'s exact commit record and every component verifies (deep)."""
        try:
            rec = self.catalog.load_commit(ref.step, ref.attempt)
            if rec.manifest_digest() != ref.manifest_digest:
                return False
            return not self.catalog.check_components(rec, None, True)
        except (CorruptionError, NotFoundError, StoreUnavailableError):
            return False

    # -------------------------------------------------------------------- gc
    def gc(self, *, keep_last: int, dry_run: bool = False, deep: bool = False,
           grace_seconds: float = 3600.0, timing: PieceTiming | None = None) -> GcReport:
        """Garbage collection of the local tier alone (judged by the local
        attempt mirror: the durable tier is neither read nor touched; a
        version-3 run's local pieces swept by the §9.5 rule with ``timing``)."""
        return collect(self.own_catalog, keep_last=keep_last, keep_every=None, grace_seconds=grace_seconds,
                       dry_run=dry_run, deep=deep, timing=timing)
