"""The catalog: one walk over a run's candidate commits, shared by selection
(``latest_complete``), listing (``list_saves``) and gc's view of the run
(PROTOCOL.md §4.4, §4.5).

Selection walks the commits newest first as :class:`~ckptstore.core.commit_names.CommitKeys`
pages them and lists only each candidate's own save prefix, so its cost
follows the candidates tried, not the history. ``list_saves`` and gc judge
every commit from one full listing of ``commits/`` and ``saves/`` and one
bounded read of each record, which is cached per store (records are created
once and never changed): a later call in the same process reads only records
it has not seen (see :class:`RecordCache`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from ..backends.base import ObjectInfo
from ..errors import CorruptionError, LimitReachedError, NotFoundError, RunRecordMismatchError
from ..protocol import (
    CommitRecord,
    UnsupportedVersion,
    component_key,
    is_component_name,
    parse_save_id,
    save_prefix,
    saves_prefix,
)
from ..protocol.auth import AuthPolicy
from ..protocol.layout import COMMITS_DIR, PIECES_VERSION, parse_piece_key, pieces_prefix
from ..protocol.pieces import ListedPiece
from ..protocol.records import MAX_COMMIT_RECORD
from ..protocol.selection import (
    MAX_CANDIDATES,
    SaveInfo,
    SaveRef,
    SaveState,
    Selection,
    Skip,
    SkipReason,
    bound_skips,
    candidate_order,
    describe_superseder,
    superseded_by,
    uncommitted_state,
)
from . import record_pack
from .binding import version_mismatch
from .bounded_io import RunIO
from .commit_names import CommitKeys
from .fencing import AttemptLog, AttemptView
from .intents import list_intents
from .piece_evidence import list_pieces
from .piece_reads import check_pieces
from .record_auth import RecordAuth, sidecars_prefix
from .selection_limits import NameSkips, gave_up

Problems = list[tuple[SkipReason, str]]
#: Commit records a store keeps decoded (:class:`RecordCache`), counted by
#: their stored size (decoded, they take several times that): 16 MiB holds
#: some 40,000 records of a one-component save.
RECORD_CACHE_BYTES = 16 << 20
#: A full walk reads the records it has not cached in batches of at most this
#: many records and listed bytes (concurrent requests on an object store).
BATCH_RECORDS = 256
BATCH_BYTES = 32 << 20


@dataclass
class Scan:
    """What a walk judges against: the run's attempts, and either its commits
    and the objects under its saves as two full listings (``list_saves``, gc)
    or nothing listed up front (selection: ``saves_listed=False``, each
    candidate lists its own save prefix)."""

    commits: dict[tuple[int, int], ObjectInfo]
    save_objects: dict[str, dict[str, ObjectInfo]]
    attempts: AttemptView
    #: False: ``save_objects`` was not listed; each candidate lists its own save prefix
    saves_listed: bool = True
    #: manifest digests deep-verified earlier in the same operation (not re-hashed)
    memo: set[str] | None = None
    #: record bytes read ahead in one batch (``Catalog.walk``), by key; None: missing
    fetched: dict[str, bytes | None] = field(default_factory=dict)
    #: keys under ``saves/`` that are not ``<save ID>/<component name>`` (a ``..``
    #: segment, another spelling of a save ID ...), and under ``pieces/`` that are
    #: not ``<save ID>/<64 hex>``: not ckptstore's, never judged, never deleted; reported by gc
    foreign: list[str] = field(default_factory=list)
    #: version 3: the run's pieces as one listing showed them (None: not listed;
    #: each candidate lists the holders it names)
    pieces: dict[tuple[str, str], ListedPiece] | None = None
    #: pieces hashed and found good earlier in the same operation (each is hashed once)
    piece_memo: set[tuple[str, str]] = field(default_factory=set)
    #: the wall-clock time just before ``pieces`` was listed: gc judges a piece's age against it
    pieces_listed_at: float = 0.0
    #: commit names of the other version's naming (step, attempt -> key): history, never junk
    #: (THREATS.md §4.13); empty where the walk lists the names itself (selection)
    other: dict[tuple[int, int], str] = field(default_factory=dict)
    #: records of the run's own naming read by the walk that state another protocol version (key, version)
    stamped: list[tuple[str, int]] = field(default_factory=list)
    #: the auth sidecars of the commit records, listed once (None: not listed; each is read when needed)
    sidecars: dict[str, ObjectInfo] | None = None
    #: record bytes this walk read or took from the record pack, with their listing entries, by key
    #: (None: the backend cannot prove pack entries, §4.7.1); what a writer's pack is made of
    raw: dict[str, tuple[ObjectInfo, bytes]] | None = None

    @classmethod
    def take(cls, io: RunIO, attempts: AttemptView, *, with_saves: bool = True, sidecars: bool = False,
             clock: Callable[[], float] = time.time) -> Scan:
        """``sidecars``: also list the commit records' auth sidecars (one listing), so
        judging a record reads its sidecar only when the listing shows one. ``clock``
        dates the pieces listing (gc ages pieces by it, §9.5)."""
        # pieces are listed before the commits (§9.5): a piece a commit listed
        # later names was either in this listing or is younger than it
        pieces_at = clock()
        foreign: list[str] = []  # keys under saves/ and pieces/ that are not ckptstore's
        pieces = list_pieces(io, foreign=foreign) if with_saves and io.layout.pieces else None
        names = CommitKeys(io)
        commits = names.listed()
        # after the commits: a record listed above whose sidecar is missing here had none when it was listed
        side = {o.key: o for o in io.list(sidecars_prefix(io.run_id, COMMITS_DIR), flat=True)} if sidecars else None
        save_objects: dict[str, dict[str, ObjectInfo]] = {}
        if not with_saves:
            return cls(commits, save_objects, attempts, saves_listed=False, other=names.other, sidecars=side)
        sp = saves_prefix(io.run_id)
        for o in io.list(sp):
            sid, _, name = o.key[len(sp) :].partition("/")
            if parse_save_id(sid) is None or not is_component_name(name):
                foreign.append(o.key)
                continue
            save_objects.setdefault(sid, {})[name] = o
        return cls(commits, save_objects, attempts, foreign=foreign, pieces=pieces, pieces_listed_at=pieces_at,
                   other=names.other, sidecars=side)


class RecordCache:
    """Decoded commit records by key, each with the (size, time) its listing
    showed when it was read, and its bytes (what a writer's record pack is
    made of, §4.7.1): a record is used again only while the listing shows the
    same entry (a record deleted by gc and created again under the same name
    is read again). Bounded by :data:`RECORD_CACHE_BYTES` of stored bytes."""

    def __init__(self, limit: int = RECORD_CACHE_BYTES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._items: dict[str, tuple[tuple[int, float], CommitRecord, bytes]] = {}
        self._bytes = 0

    def get(self, key: str, seen: tuple[int, float]) -> CommitRecord | None:
        with self._lock:
            hit = self._items.get(key)
        return hit[1] if hit is not None and hit[0] == seen else None

    def data(self, key: str, seen: tuple[int, float]) -> bytes | None:
        """The bytes the record was decoded from, while the listing shows the same entry."""
        with self._lock:
            hit = self._items.get(key)
        return hit[2] if hit is not None and hit[0] == seen else None

    def put(self, key: str, seen: tuple[int, float], rec: CommitRecord, data: bytes) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[0][0]
            self._items[key] = (seen, rec, data)
            self._bytes += seen[0]
            while self._bytes > self.limit and self._items:
                victim = next(iter(self._items))
                self._bytes -= self._items.pop(victim)[0][0]


def part_names(rec: CommitRecord, rank: int | None) -> frozenset[str] | None:
    """The components of ``rec`` that rank ``rank`` wrote (its part), or None
    (all of them) when ``rank`` is None or the record has no ``ranks`` map.
    A rank the map does not name holds no part (empty)."""
    if rank is None or rec.ranks is None:
        return None
    return frozenset(rec.ranks.get(rank, ()))


@dataclass(frozen=True)
class Candidate:
    """One commit as the walk judged it."""

    step: int
    attempt: int
    ref: SaveRef | None
    problems: Problems
    save_id: str | None


def commit_info(c: Candidate, objs: Mapping[str, ObjectInfo], hashed: bool, mtime: float | None,
                selected: bool) -> SaveInfo:
    """The listing row of a judged commit (``hashed``: its deep check ran)."""
    if c.ref is not None:
        state, detail = SaveState.COMMITTED, "verified" if hashed else "sizes verified"
    elif c.problems[0][0] is SkipReason.SUPERSEDED:
        state, detail = SaveState.SUPERSEDED, c.problems[0][1]
    elif c.problems[0][0] is SkipReason.UNSUPPORTED_VERSION:
        state, detail = SaveState.UNSUPPORTED, c.problems[0][1]
    else:
        state, detail = SaveState.CORRUPT, "; ".join(d for _, d in c.problems)
    written = referenced = None
    if c.ref is not None:
        written, referenced = c.ref.record.bytes_written(), c.ref.total_bytes
    return SaveInfo(
        c.save_id or "?", c.step, c.attempt, state, detail, sum(o.size for o in objs.values()), len(objs), mtime,
        selected=selected, ref=c.ref, bytes_written=written, bytes_referenced=referenced,
    )


def uncommitted_info(sid: str, sa: tuple[int, int], objs: Mapping[str, ObjectInfo], pieces: list[ListedPiece],
                     now: float, grace_seconds: float, attempts: AttemptView) -> SaveInfo:
    """The listing row of a save with no commit of its (step, attempt): in
    progress or partial by the age of its newest write, partial when its writer was replaced."""
    size = sum(o.size for o in objs.values()) + sum(p.size for p in pieces)
    what = f"{len(objs)} component(s)" + (f" and {len(pieces)} piece(s)" if pieces else "")
    newest = max([o.mtime for o in objs.values()] + [p.mtime for p in pieces])
    state = uncommitted_state(now - newest, grace_seconds)
    detail = f"{what} written, no commit record; last write {now - newest:.0f}s ago"
    later = superseded_by(sa[0], sa[1], attempts.effective)
    if later is not None:
        # its writer was replaced before this step: it can never be committed
        state = SaveState.PARTIAL
        detail = f"abandoned ({describe_superseder(later)}); {detail}"
    return SaveInfo(sid, sa[0], sa[1], state, detail, size, len(objs), None)


class Catalog:
    """Reads and judges one run's commits."""

    def __init__(self, io: RunIO, attempts: AttemptLog, identity_digest: str) -> None:
        self.io = io
        self.attempts = attempts
        self.auth: RecordAuth = attempts.auth
        self.identity_digest = identity_digest
        self.records = RecordCache()
        #: a store opened for writing keeps the run's record pack up to date (§4.7.1); readers never write
        self.writes_pack = False
        #: commit keys the record pack held when this store last read or wrote it
        self.packed: set[str] = set()
        #: a local tier of one rank of a multi-rank run (PROTOCOL.md §"Tiers"): only the
        #: components the record's ``ranks`` map gives this rank are checked; None: all
        self.part: int | None = None

    def scan(self, attempts: AttemptView | None = None, *, with_saves: bool = True,
             clock: Callable[[], float] = time.time) -> Scan:
        """One listing of the run; ``clock`` dates the pieces listing (gc ages pieces by it, §9.5)."""
        return Scan.take(self.io, attempts if attempts is not None else self.attempts.load(), with_saves=with_saves,
                         sidecars=self.auth.policy is not AuthPolicy.OFF and self.auth.keyring is not None,
                         clock=clock)

    def _objects_of(self, scan: Scan, save_id: str) -> dict[str, ObjectInfo]:
        if scan.saves_listed:
            return scan.save_objects.get(save_id, {})
        prefix = save_prefix(self.io.run_id, save_id)
        return {o.key[len(prefix) :]: o for o in self.io.list(prefix)}

    # -------------------------------------------------------------- records
    def commit_key(self, step: int, attempt: int) -> str:
        return self.io.layout.commit_key(self.io.run_id, step, attempt)

    def load_commit(
        self, step: int, attempt: int, listed: ObjectInfo | None = None, key: str | None = None,
        fetched: dict[str, bytes | None] | None = None,
    ) -> CommitRecord:
        """The decoded record (one bounded read, or the bytes ``fetched`` ahead),
        or the cached one when ``listed`` (its listing entry) matches the entry
        it was read under."""
        key = key or self.commit_key(step, attempt)
        seen = (listed.size, listed.mtime) if listed is not None else None
        if seen is not None and (hit := self.records.get(key, seen)) is not None:
            return hit
        if fetched is not None and key in fetched:
            data = fetched.pop(key)
            if data is None:
                raise NotFoundError(f"{self.io.where(key)}: no such object")
            if listed is not None and len(data) > listed.size:
                raise CorruptionError(
                    f"{self.io.where(key)}: the commit record grew since it was listed ({listed.size} bytes listed, "
                    "found more); commit records are written once, so this one was rewritten"
                )
        else:
            data = self.io.get_bounded(key, MAX_COMMIT_RECORD)
        rec = CommitRecord.decode(data, self.io.where(key), run_id=self.io.run_id, step=step, attempt=attempt)
        if seen is not None and seen[0] == len(data):
            self.records.put(key, seen, rec, data)
        return rec

    def check_components(
        self, rec: CommitRecord, listed: Mapping[str, ObjectInfo] | None, deep: bool, scan: Scan | None = None,
    ) -> Problems:
        """Every component present with its recorded size (from ``listed``, or
        one size request each); with ``deep``, re-hashed (never reading more
        than its recorded size + 1 bytes). A pieced component: every piece
        present with its size (from the scan's listing of ``pieces/``, or one
        listing per holder), with ``deep`` each piece hashed once per scan.
        With :attr:`part` set, only that rank's components (pieced or not)."""
        mine = part_names(rec, self.part)
        problems: Problems = []
        if rec.version >= PIECES_VERSION:  # an older record names no piece (its decoder refuses them)
            problems = check_pieces(
                self.io, (c for n, c in rec.components.items() if mine is None or n in mine),
                scan.pieces if scan is not None else None, deep, scan.piece_memo if scan is not None else None,
            )
        if mine is not None and not mine:
            problems.append((SkipReason.MISSING_COMPONENT, f"the record gives rank {self.part} no component"))
        for name, comp in sorted(rec.components.items()):
            if comp.pieces is not None or (mine is not None and name not in mine):
                continue
            key = component_key(self.io.run_id, rec.save_id, name)
            size: int | None
            if listed is not None:
                info = listed.get(name)
                size = info.size if info is not None else None
            else:
                try:
                    size = self.io.size(key)
                except NotFoundError:
                    size = None
            if size is None:
                problems.append((SkipReason.MISSING_COMPONENT, f"component {name!r} is missing"))
                continue
            if size != comp.size:
                problems.append(
                    (SkipReason.SIZE_MISMATCH, f"component {name!r} has {size} bytes, record says {comp.size}")
                )
                continue
            if deep:
                try:
                    seen, digest = self.io.hash_object(key, comp.size)
                except NotFoundError:
                    problems.append((SkipReason.MISSING_COMPONENT, f"component {name!r} vanished while hashing"))
                    continue
                if seen != comp.size:
                    problems.append(
                        (SkipReason.SIZE_MISMATCH, f"component {name!r} changed size while hashing ({seen} bytes)")
                    )
                elif digest != comp.blake3:
                    problems.append((SkipReason.HASH_MISMATCH, f"component {name!r} BLAKE3 does not match the record"))
        return problems

    def evaluate(self, step: int, attempt: int, scan: Scan, deep: bool) -> Candidate:
        """Judge one commit: a ref if it verifies, else its problems."""
        if attempt not in scan.attempts.records and attempt not in scan.attempts.unreadable:
            detail = f"made by attempt {attempt}, which was never registered (record not read)"
            return Candidate(step, attempt, None, [(SkipReason.UNREGISTERED_ATTEMPT, detail)], None)
        later = superseded_by(step, attempt, scan.attempts.effective)
        listed = scan.commits.get((step, attempt))
        key = listed.key if listed is not None else self.commit_key(step, attempt)
        try:
            rec = self.load_commit(step, attempt, listed, key, scan.fetched)
        except UnsupportedVersion as exc:
            return Candidate(step, attempt, None, [(SkipReason.UNSUPPORTED_VERSION, str(exc))], None)
        except NotFoundError:
            return Candidate(step, attempt, None, [(SkipReason.UNREADABLE_RECORD, "commit record vanished")], None)
        except CorruptionError as exc:
            return Candidate(step, attempt, None, [(SkipReason.UNREADABLE_RECORD, str(exc))], None)
        sid = rec.save_id
        if rec.version != self.io.layout.version:
            # a writer stamps every record with its run's version (PROTOCOL.md §1.1): this one was
            # written for a run of another version, or the run record was edited (THREATS.md §4.13)
            scan.stamped.append((key, rec.version))
            detail = (f"the record states protocol_version {rec.version}, the run record "
                      f"{self.io.layout.version}: written for another version's run, or RUN.json was edited")
            return Candidate(step, attempt, None, [(SkipReason.UNREADABLE_RECORD, detail)], sid)
        why = self.auth.judge(rec, self.io.run_id, self.io, key, scan.sidecars)
        if why is not None:
            return Candidate(step, attempt, None, [(SkipReason.UNAUTHENTICATED, why)], sid)
        if later is not None:
            return Candidate(step, attempt, None, [(SkipReason.SUPERSEDED, describe_superseder(later))], sid)
        if rec.identity_digest != self.identity_digest:
            detail = "commit was made under another identity"
            return Candidate(step, attempt, None, [(SkipReason.IDENTITY_MISMATCH, detail)], sid)
        digest = rec.manifest_digest() if deep and scan.memo is not None else ""
        hashed_before = bool(digest) and digest in (scan.memo or ())
        problems = self.check_components(rec, self._objects_of(scan, sid), deep and not hashed_before, scan)
        if digest and not problems and scan.memo is not None:
            scan.memo.add(digest)
        return Candidate(step, attempt, None if problems else SaveRef.of(rec), problems, sid)

    def walk(
        self, scan: Scan, deep: bool, deep_until: int | None = None, order: Iterable[tuple[int, int]] | None = None
    ) -> Iterator[Candidate]:
        """Every commit, newest first (``order``, else the scan's commits
        sorted), judged; a step already committed by a later attempt that
        verified makes older commits of it superseded. With ``deep_until=k``,
        the deep check stops once ``k`` commits verified (older ones get the
        size check)."""
        seen_steps: set[int] = set()
        verified = 0
        for step, attempt in order if order is not None else self._fetching(scan):
            c = self.evaluate(step, attempt, scan, deep and (deep_until is None or verified < deep_until))
            if c.ref is not None and step not in seen_steps:
                verified += 1
            if c.ref is not None and step in seen_steps:
                detail = f"step {step} was committed again by a later attempt"
                c = Candidate(step, attempt, None, [(SkipReason.SUPERSEDED, detail)], c.save_id)
            if c.ref is not None:
                seen_steps.add(step)
            yield c

    def _refresh_pack(self, scan: Scan) -> None:
        """A writer's record pack (§4.7.1), written again when at least
        :data:`~ckptstore.core.record_pack.MIN_NEW_RECORDS` listed records are
        not in the pack this store last read or wrote: from the bytes this walk
        read and those the record cache holds under the same listing entry."""
        assert scan.raw is not None
        records: dict[str, tuple[ObjectInfo, bytes]] = {}
        for info in scan.commits.values():
            got = scan.raw.get(info.key)
            data = got[1] if got is not None else self.records.data(info.key, (info.size, info.mtime))
            if data is not None:
                records[info.key] = (info, data)
        if sum(k not in self.packed for k in records) >= record_pack.MIN_NEW_RECORDS and record_pack.write_pack(
            self.io, records
        ):
            self.packed = set(records)

    def _fetching(self, scan: Scan) -> Iterator[tuple[int, int]]:
        """The scan's commits newest first; before each batch of them, the
        records the cache does not hold are read in one ``get_many``."""
        order = candidate_order(scan.commits)
        packed: dict[str, bytes] = {}
        if record_pack.usable(self.io):
            # the record pack (§4.7.1) only when it can save requests: bytes proven to be the listed records'
            missing = {info.key: info for sa, info in scan.commits.items() if sa[1] in scan.attempts.records
                       and self.records.get(info.key, (info.size, info.mtime)) is None}
            if len(missing) >= record_pack.MIN_NEW_RECORDS:
                packed = record_pack.read_pack(self.io, missing)
                self.packed = set(packed)
            scan.raw = {}
        i = 0
        while i < len(order):
            batch: list[tuple[int, int]] = []
            size = 0
            while i < len(order) and len(batch) < BATCH_RECORDS and (not batch or size < BATCH_BYTES):
                batch.append(order[i])
                size += scan.commits[order[i]].size
                i += 1
            want, sizes = [], []
            scan.fetched = {}
            for sa in batch:
                info = scan.commits[sa]
                if sa[1] in scan.attempts.records and self.records.get(info.key, (info.size, info.mtime)) is None:
                    if info.key in packed:
                        scan.fetched[info.key] = packed[info.key]
                        continue
                    want.append(info.key)
                    sizes.append(info.size)
            got = dict(zip(want, self.io.get_many_bounded(want, MAX_COMMIT_RECORD, sizes), strict=True))
            scan.fetched.update(got)
            if scan.raw is not None:
                for sa in batch:
                    info = scan.commits[sa]
                    if (data := scan.fetched.get(info.key)) is not None:
                        scan.raw[info.key] = (info, data)
            yield from batch
        scan.fetched = {}

    # ------------------------------------------------------------ selection
    def select(
        self, deep: bool, attempts: AttemptView | None = None, *, explain: bool = True, memo: set[str] | None = None
    ) -> Selection:
        """The newest commit that verifies: candidates as :class:`CommitKeys`
        pages them newest first, each checked against a listing of its own
        save prefix, so the cost follows the candidates tried, not the history.
        ``explain`` also reports uncommitted saves newer than the choice (one
        listing of the save keys after it). ``memo``: manifest digests
        deep-verified earlier in the same operation, not re-hashed (extended
        with what this call verifies)."""
        view = attempts if attempts is not None else self.attempts.load()
        scan = Scan({}, {}, view, saves_listed=False, memo=memo)
        keys = CommitKeys(self.io)
        skipped: list[Skip] = []
        committed_ids: set[str] = set()
        tried: set[tuple[int, int]] = set()  # (step, attempt) of every candidate tried
        chosen: SaveRef | None = None
        notes = list(view.notes())
        by_name = NameSkips(view, keep_names=explain)
        read = 0
        for c in self.walk(scan, deep, order=by_name.filter(keys.newest_first())):
            read += 1  # only candidates whose record was read count against the bound
            if c.save_id:
                committed_ids.add(c.save_id)
            tried.add((c.step, c.attempt))
            if c.ref is not None:
                chosen = c.ref
                break
            skipped.append(Skip(c.step, c.attempt, c.save_id, c.problems[0][0], "; ".join(d for _, d in c.problems)))
            if read >= MAX_CANDIDATES:
                if scan.stamped:
                    raise self.mismatch(keys.other, scan.stamped)
                raise gave_up(self.io.run_id, MAX_CANDIDATES, skipped, by_name.count)
        if chosen is None and (keys.other or scan.stamped):
            # nothing of the run's own version selectable, and history of another: never "no save"
            raise self.mismatch(keys.other, scan.stamped)
        if keys.junk:
            notes.append(f"{keys.junk} name(s) under commits/ are not commit records of this run's layout; ignored")
        if keys.other:
            notes.append(self._other_note(keys.other))
        if explain:
            try:
                skipped += self._uncommitted_after(chosen, committed_ids, tried | by_name.names | set(keys.other))
            except LimitReachedError as exc:  # the report of uncommitted saves only; the choice stands
                notes.append(f"uncommitted saves not reported: {exc}")
        shown, more = bound_skips(skipped + by_name.skips)
        return Selection(chosen, shown, more + by_name.count - len(by_name.skips), tuple(notes), read - (chosen is not None))

    def mismatch(self, other: Mapping[tuple[int, int], str], stamped: list[tuple[str, int]]) -> RunRecordMismatchError:
        """The refusal of a run whose run record disagrees with its commit
        records (:func:`~ckptstore.core.binding.version_mismatch`), naming the
        version the newest record of the other naming states (one bounded read)."""
        stated: int | None = None
        if other:
            sa = max(other)
            try:
                data = self.io.get_bounded(other[sa], MAX_COMMIT_RECORD)
                stated = CommitRecord.decode(data, self.io.where(other[sa]), run_id=self.io.run_id,
                                             step=sa[0], attempt=sa[1]).version
            except (CorruptionError, NotFoundError):  # unreadable, or a newer version's: the naming is named only
                pass
        return version_mismatch(self.io, other, stamped, stated)

    def _other_note(self, other: Mapping[tuple[int, int], str]) -> str:
        return (f"{len(other)} name(s) under commits/ follow another protocol version's commit naming, not this "
                f"run's (version {self.io.layout.version}): history, never selected or deleted, their saves kept; "
                f"newest {self.io.where(other[max(other)])} (if RUN.json was edited, restore it)")

    def _intent_names(self) -> set[tuple[str, str]]:
        """What the run's live save intents name (none when they cannot be listed or read: listing only)."""
        try:
            intents, _ = list_intents(self.io)
        except (LimitReachedError, CorruptionError, NotFoundError):
            return set()
        now = time.time()
        return {hd for rec in intents.values() if rec.expires_at > now for hd in rec.pieces}

    def _uncommitted_after(
        self, chosen: SaveRef | None, committed_ids: set[str], known: set[tuple[int, int]]
    ) -> list[Skip]:
        """Uncommitted saves newer than ``chosen`` (their IDs carry step and
        attempt, and sort by them): the save keys listed from just after it.
        ``known``: (step, attempt) of every commit key that was tried (that
        candidate's own skip says why it was not selected) or skipped by name
        (its save ID is not known): their saves are not reported as uncommitted."""
        sp = saves_prefix(self.io.run_id)
        tail = f"{chosen.step:012d}-{chosen.attempt:08d}-~" if chosen is not None else ""
        counts: dict[str, int] = {}
        for key in self.io.list_keys(sp, start_after=sp + tail if tail else ""):
            sid, _, name = key[len(sp) :].partition("/")
            if is_component_name(name):  # anything else under saves/ is not ckptstore's (see Scan.foreign)
                counts[sid] = counts.get(sid, 0) + 1
        pieces: dict[str, int] = {}
        if self.io.layout.pieces:  # version 3: an uncommitted save may have written nothing but pieces (§9.5)
            pp = pieces_prefix(self.io.run_id)
            for key in self.io.list_keys(pp, start_after=pp + tail if tail else ""):
                hd = parse_piece_key(self.io.run_id, key)
                if hd is not None:
                    pieces[hd[0]] = pieces.get(hd[0], 0) + 1
        out = []
        for sid in sorted(set(counts) | set(pieces)):
            sa = parse_save_id(sid)
            if sid in committed_ids or sa is None or sa in known or (
                chosen is not None and sa <= (chosen.step, chosen.attempt)
            ):
                continue
            n, k = counts.get(sid, 0), pieces.get(sid, 0)
            what = f"{n} component(s)" if not k else f"{k} piece(s)" if not n else f"{n} component(s) and {k} piece(s)"
            out.append(Skip(sa[0], sa[1], sid, SkipReason.NO_COMMIT, f"{what} written, no commit record"))
        return out

    def judge_one(
        self, step: int, attempt: int, listed: ObjectInfo | None, attempts: AttemptView, deep: bool,
    ) -> tuple[Candidate, dict[str, ObjectInfo]]:
        """One commit judged as a full walk would judge it, from a listing of
        its own save prefix (returned: the save's objects by component name),
        for retention that touches what it deletes (``core.collector.Retention``)."""
        sid: str | None = None
        try:
            sid = self.load_commit(step, attempt, listed, listed.key if listed is not None else None).save_id
        except (UnsupportedVersion, NotFoundError, CorruptionError):
            pass  # evaluate says why
        objs: dict[str, ObjectInfo] = {}
        if sid is not None:
            prefix = save_prefix(self.io.run_id, sid)
            objs = {o.key[len(prefix) :]: o for o in self.io.list(prefix) if is_component_name(o.key[len(prefix) :])}
        scan = Scan({(step, attempt): listed} if listed is not None else {}, {sid: objs} if sid else {}, attempts)
        return self.evaluate(step, attempt, scan, deep), objs

    def get_save(self, step: int, attempt: int | None = None) -> SaveRef:
        """The commit of ``step`` (the highest attempt, unless given); not verified."""
        if attempt is None:
            found = CommitKeys(self.io).attempts_of(step)
            if not found:
                raise NotFoundError(f"run {self.io.run_id!r} has no commit for step {step}")
            attempt = found[0]
        try:
            return SaveRef.of(self.load_commit(step, attempt))
        except NotFoundError:
            raise NotFoundError(f"run {self.io.run_id!r} has no commit for step {step}, attempt {attempt}") from None

    # -------------------------------------------------------------- listing
    def list_saves(
        self, scan: Scan, deep: bool, grace_seconds: float, deep_until: int | None = None
    ) -> list[SaveInfo]:
        """Every save of the run, committed or not, newest first, with its state
        (``deep_until``: see :meth:`walk`)."""
        latest: SaveRef | None = None
        out: list[SaveInfo] = []
        committed_ids: set[str] = set()
        named: set[tuple[str, str]] = set()  # pieces a committed save names (its holder's commit may be gone)
        verified = 0
        for c in self.walk(scan, deep, deep_until):
            if c.ref is not None:
                verified += 1
            if c.ref is not None and latest is None:
                latest = c.ref
            if c.save_id:
                committed_ids.add(c.save_id)
            hashed = deep and (deep_until is None or verified <= deep_until)
            selected = latest is not None and c.ref is not None and c.ref.save_id == latest.save_id
            out.append(commit_info(c, scan.save_objects.get(c.save_id or "", {}), hashed,
                                   scan.commits[(c.step, c.attempt)].mtime, selected))
            if c.ref is not None:
                named.update(c.ref.record.piece_refs())
        if latest is None and (scan.other or scan.stamped):
            raise self.mismatch(scan.other, scan.stamped)
        if self.writes_pack and scan.raw is not None:
            self._refresh_pack(scan)
        now = time.time()
        # version 3: pieces no commit names, by the save that wrote them (an uncommitted save may
        # have written nothing else: every byte of its components is in pieces, §9.1)
        loose: dict[str, list[ListedPiece]] = {}
        for hd, lp in (scan.pieces or {}).items():
            if hd[0] not in committed_ids and hd not in named:
                loose.setdefault(hd[0], []).append(lp)
        # a holder some commit still names had its own commit deleted (retention): what only it
        # named is gc's to sweep after the grace period, not a save of its own
        for h in {hd[0] for hd in named}:
            if h not in scan.save_objects:
                loose.pop(h, None)
        if loose:
            # a holder every listed piece of which a live save intent names: a deleted commit's pieces that
            # a writer still relies on (a killed writer's intent, until it expires), not a save in progress
            # (a save's own new pieces are never in an intent)
            held = self._intent_names()
            for h in [h for h, ps in loose.items() if h not in scan.save_objects
                      and all((p.holder, p.digest) in held for p in ps)]:
                del loose[h]
        for sid in sorted(set(scan.save_objects) | set(loose)):
            if sid in committed_ids:
                continue
            objs = scan.save_objects.get(sid, {})
            pieces = loose.get(sid, [])
            sa = parse_save_id(sid)
            if sa is None:
                continue  # a directory whose name does not parse is not ckptstore's: never listed, never deleted
            size = sum(o.size for o in objs.values()) + sum(p.size for p in pieces)
            what = f"{len(objs)} component(s)" + (f" and {len(pieces)} piece(s)" if pieces else "")
            if sa in scan.commits:
                # Its (step, attempt) has a commit key whose record does not name
                # it (unreadable, torn, forged): it may be that commit's save.
                # Kept as corrupt for an operator, never taken for uncommitted.
                detail = (
                    f"{what} written; the commit record of step {sa[0]}, attempt {sa[1]} exists "
                    "but does not name this save (unreadable or another save's): kept; inspect it and remove by hand"
                )
                out.append(SaveInfo(sid, sa[0], sa[1], SaveState.CORRUPT, detail, size, len(objs), None))
                continue
            if sa in scan.other:
                # a commit name of another version's naming has its (step, attempt): history (§4.13)
                detail = (
                    f"{what} written; {self.io.where(scan.other[sa])} names step {sa[0]}, attempt {sa[1]} in another "
                    "protocol version's commit naming: kept as history (if RUN.json was edited, restore it)"
                )
                out.append(SaveInfo(sid, sa[0], sa[1], SaveState.CORRUPT, detail, size, len(objs), None))
                continue
            out.append(uncommitted_info(sid, sa, objs, pieces, now, grace_seconds, scan.attempts))
        out.sort(key=lambda i: (i.step, i.attempt), reverse=True)
        return out
