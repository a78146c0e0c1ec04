"""Attempts and fencing (PROTOCOL.md §4.2, §5).

One attempt per job start: its number is created with create-if-absent, so
no two jobs hold the same one, and it fences every older writer. Attempt
records never change after they are written, so decoded ones are cached and
each fence check costs one listing.

Stored attempt records are input, not truth: an unreadable one, or one of a
newer protocol version, fences nothing (a planted junk record cannot hide the
run's history) but its number is never taken by a writer, and gc refuses to
delete while one exists (``AttemptView.unreadable``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import CorruptionError, NotFoundError, StoreUnavailableError, SupersededError
from ..protocol import MAX_ATTEMPT, AttemptRecord, attempt_key, attempt_of_key, attempts_prefix, now
from ..protocol.records import MAX_ATTEMPT_RECORD
from ..protocol.selection import SaveRef, describe_superseder, effective_attempts, superseded_by
from .bounded_io import RunIO
from .record_auth import RecordAuth

ResumePoint = int | None


@dataclass(frozen=True)
class AttemptView:
    """The attempts of a run at one listing."""

    records: dict[int, AttemptRecord]
    #: number -> why the record cannot be used (unreadable, newer version)
    unreadable: dict[int, str] = field(default_factory=dict)
    #: keys under ``attempts/`` that are not an attempt record's canonical key
    #: (another spelling of a number, a sub-folder ...): ignored, counted here
    junk: int = 0

    @cached_property
    def effective(self) -> dict[int, AttemptRecord]:
        return effective_attempts(self.records)

    @property
    def highest(self) -> int:
        return max([*self.records, *self.unreadable], default=0)

    def below(self, n: int) -> AttemptView:
        return AttemptView(
            {k: v for k, v in self.records.items() if k < n}, {k: v for k, v in self.unreadable.items() if k < n}
        )

    def notes(self) -> tuple[str, ...]:
        out = [f"attempt record {n} ignored: {why}" for n, why in sorted(self.unreadable.items())[:20]]
        if self.junk:
            out.append(f"{self.junk} name(s) under attempts/ are not attempt records of this run; ignored")
        return tuple(out)


class AttemptLog:
    """Reads, creates and caches one run's attempt records."""

    def __init__(self, io: RunIO, auth: RecordAuth | None = None) -> None:
        self.io = io
        self.auth = auth or RecordAuth()
        self._cache: dict[int, AttemptRecord] = {}

    def load(self) -> AttemptView:
        """Every attempt record: one listing (names only), and a bounded read
        only for numbers not seen before."""
        records: dict[int, AttemptRecord] = {}
        unreadable: dict[int, str] = {}
        junk = 0
        prefix = attempts_prefix(self.io.run_id)
        for key in self.io.list_keys(prefix, flat=True):  # flat: a folder planted there is not walked
            n = attempt_of_key(self.io.run_id, key)  # the canonical key only, never a twin
            if n is None:
                junk += 1
                continue
            cached = self._cache.get(n)
            if cached is not None:
                records[n] = cached
                continue
            try:
                data = self.io.get_bounded(key, MAX_ATTEMPT_RECORD)
                rec = AttemptRecord.decode(data, self.io.where(key), run_id=self.io.run_id, number=n)
            except NotFoundError:
                continue
            except CorruptionError as exc:
                unreadable[n] = str(exc)
                continue
            why = self.auth.judge(rec, self.io.run_id, self.io, key)
            if why is not None:
                unreadable[n] = why
                continue
            records[n] = self._cache[n] = rec
        return AttemptView(records, unreadable, junk)

    def read(self, number: int) -> AttemptRecord:
        key = attempt_key(self.io.run_id, number)
        try:
            data = self.io.get_bounded(key, MAX_ATTEMPT_RECORD)
        except NotFoundError:
            raise NotFoundError(
                f"run {self.io.run_id!r} has no attempt {number}: the coordinator must register it before "
                "other processes join it"
            ) from None
        rec = AttemptRecord.decode(data, self.io.where(key), run_id=self.io.run_id, number=number)
        why = self.auth.judge(rec, self.io.run_id, self.io, key)
        if why is not None:
            raise CorruptionError(f"{self.io.where(key)}: attempt {number} is {why}")
        self._cache[number] = rec
        return rec

    def join(self, number: int) -> AttemptRecord:
        """Attempt record ``number``, for a member of the job that registered
        it; refused with :class:`SupersededError` when a later attempt that
        counts for fencing was registered since (the member belongs to an
        older job, or to an earlier generation of restarted workers)."""
        rec = self.read(number)
        effective = self.load().effective
        later = sorted(n for n in effective if n > number)
        if later:
            newer = effective[later[-1]]
            raise SupersededError(
                f"run {self.io.run_id!r}: cannot join attempt {number}: {describe_superseder(newer)} after it "
                "(a newer job, or a newer generation of restarted workers, owns the run). Stop this process; "
                "nothing was written.",
                committed=False,
            )
        return rec

    def register(
        self,
        writer_id: str,
        resume_from: ResumePoint | str,
        select: Callable[[AttemptView], SaveRef | None],
    ) -> tuple[AttemptRecord, SaveRef | None]:
        """Register a new attempt (§4.2) and return it with the save it resumes
        from (``resume_from="latest"``), chosen by ``select``."""
        abandons: list[int] = []
        for _ in range(16):
            view = self.load()
            number = view.highest + 1
            if number > MAX_ATTEMPT:
                raise self._exhausted(view)
            if resume_from == "latest":
                ref = select(view)
                step: int | None = ref.step if ref else None
            else:
                assert resume_from is None or isinstance(resume_from, int)
                ref, step = None, resume_from
            rec = self.auth.seal(
                AttemptRecord(
                    self.io.run_id, number, step, writer_id, now(), tuple(abandons), socket.gethostname()[:256],
                    version=self.io.layout.version,
                ),
                self.io.run_id,
            )
            if not self.io.create(attempt_key(self.io.run_id, number), rec.encode(), what="attempt record"):
                continue  # another process took this number; try the next one
            self._cache[number] = rec
            if resume_from == "latest":
                # A commit that landed between our selection and our registration
                # (an older writer that had not seen us yet) must be adopted, not
                # silently superseded: select again, ignoring ourselves.
                again = select(self.load().below(number))
                if (again.save_id if again else None) != (ref.save_id if ref else None):
                    abandons.append(number)
                    continue
            return rec, ref
        raise StoreUnavailableError(
            f"run {self.io.run_id!r}: could not register an attempt after 16 tries (many concurrent writers?)"
        )

    def _exhausted(self, view: AttemptView) -> StoreUnavailableError:
        """The error when no attempt number is left: it names the record that
        holds the last number (usually a planted or stray one), what it is,
        and the way out."""
        top = view.highest
        where = self.io.where(attempt_key(self.io.run_id, top))
        if top in view.unreadable:
            what = f"it is not a usable attempt record ({view.unreadable[top][:200]})"
        else:
            rec = view.records[top]
            what = (
                f"it claims writer {rec.writer_id!r} on host {rec.host[:80]!r}, resumed from step {rec.resumed_from}"
            )
        below = max((n for n in [*view.records, *view.unreadable] if n < top), default=0)
        return StoreUnavailableError(
            f"run {self.io.run_id!r}: attempt numbers are exhausted, none is left for a new writer: the attempt record {where} "
            f"takes the last one ({top}); {what}. The next highest attempt is {below}. If this run never had "
            f"that many attempts, that file is junk: remove it (by hand, after checking it) and open the run "
            "again; otherwise start a new run ID."
        )

    def check_not_superseded(self, attempt: AttemptRecord, step: int, *, committed: bool) -> None:
        """The fence: raise :class:`SupersededError` if a later attempt forked
        the history before ``step``."""
        later = superseded_by(step, attempt.number, self.load().effective)
        if later is not None:
            what = "was committed but will never be selected" if committed else "was not committed"
            raise SupersededError(
                f"run {self.io.run_id!r}: this writer (attempt {attempt.number}) is superseded: "
                f"{describe_superseder(later)}. The save of step {step} {what}. Stop this process; "
                "the newer attempt owns the run.",
                committed=committed,
            )

