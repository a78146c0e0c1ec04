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

from .authn import RecordAuth
from .errors import CorruptionError, NotFoundError, StoreUnavailableError, SupersededError
from .protocol import MAX_ATTEMPT, AttemptRecord, attempt_key, attempts_prefix, now, parse_attempt_name
from .protocol.records import MAX_ATTEMPT_RECORD
from .protocol.selection import SaveRef, describe_superseder, effective_attempts, superseded_by
from .runio import RunIO

ResumePoint = int | None


@dataclass(frozen=True)
class AttemptView:
    """The attempts of a run at one listing."""

    records: dict[int, AttemptRecord]
    #: number -> why the record cannot be used (unreadable, newer version)
    unreadable: dict[int, str] = field(default_factory=dict)

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
        return tuple(f"attempt record {n} ignored: {why}" for n, why in sorted(self.unreadable.items())[:20])


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
        prefix = attempts_prefix(self.io.run_id)
        for key in self.io.list_keys(prefix):
            n = parse_attempt_name(key[len(prefix) :])
            if n is None:
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
        return AttemptView(records, unreadable)

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
                raise StoreUnavailableError(
                    f"run {self.io.run_id!r}: attempt numbers are exhausted (an attempt record numbered "
                    f"{view.highest} exists); start a new run ID"
                )
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

