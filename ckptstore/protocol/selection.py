"""Pure selection logic: which commits are in the run's history, in what
order candidates are tried, and what state each save is in. No I/O.

The one-history rule (PROTOCOL.md, invariant 6): a commit of step ``s`` made by
attempt ``a`` is *superseded* when some later, non-abandoned attempt ``b > a``
resumed from a step ``r_b < s`` (or started from scratch, ``r_b = None``): that
later attempt forked the history before ``s``. Among the surviving commits of
one step, the highest attempt wins.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .records import AttemptRecord, CommitRecord, ComponentEntry

#: Commit records read, newest first, before selection gives up (a store stuffed with
#: junk records cannot make a resume read without bound). Giving up is an error
#: (``LimitReachedError``), never "no save"; candidates skipped by name (superseded,
#: unregistered attempt) are not read and do not count (PROTOCOL.md §4.4).
MAX_CANDIDATES = 1000
#: Skipped candidates reported in full; the rest are counted.
MAX_REPORTED_SKIPS = 100


class SaveState(str, enum.Enum):
    """States of a save, as listed by ``CheckpointStore.list_saves()``."""

    IN_PROGRESS = "in-progress"  # components present, no commit, younger than the grace period
    PARTIAL = "partial"  # components present, no commit, older than the grace period
    COMMITTED = "committed"  # commit record present and verified
    CORRUPT = "corrupt"  # commit record present, a component or the record does not verify
    SUPERSEDED = "superseded"  # committed, but a later attempt forked history before it
    UNSUPPORTED = "unsupported"  # written by a newer protocol version


class SkipReason(str, enum.Enum):
    NO_COMMIT = "no-commit"
    MISSING_COMPONENT = "missing-component"
    SIZE_MISMATCH = "size-mismatch"
    HASH_MISMATCH = "hash-mismatch"
    SUPERSEDED = "superseded"
    UNREADABLE_RECORD = "unreadable-record"
    IDENTITY_MISMATCH = "identity-mismatch"
    UNSUPPORTED_VERSION = "unsupported-version"
    UNREGISTERED_ATTEMPT = "unregistered-attempt"
    UNAUTHENTICATED = "unauthenticated"


@dataclass(frozen=True)
class Skip:
    """A candidate newer than the selected save, and why it was not selected."""

    step: int
    attempt: int
    save_id: str | None
    reason: SkipReason
    detail: str

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "save_id": self.save_id,
            "reason": self.reason.value,
            "detail": self.detail,
        }


def effective_attempts(attempts: Mapping[int, AttemptRecord]) -> dict[int, AttemptRecord]:
    """Attempts that count for fencing: abandoned registrations are ignored."""
    abandoned: set[int] = set()
    for rec in attempts.values():
        abandoned.update(rec.abandons)
    return {n: r for n, r in attempts.items() if n not in abandoned}


def superseded_by(step: int, attempt: int, attempts: Mapping[int, AttemptRecord]) -> AttemptRecord | None:
    """The earliest later attempt that forked history before ``step``, if any.

    ``attempts`` should already be filtered by :func:`effective_attempts`.
    """
    for n in sorted(attempts):
        if n <= attempt:
            continue
        rec = attempts[n]
        if rec.resumed_from is None or rec.resumed_from < step:
            return rec
    return None


def describe_superseder(rec: AttemptRecord) -> str:
    start = "from scratch" if rec.resumed_from is None else f"from step {rec.resumed_from}"
    return f"attempt {rec.number} restarted the run {start}"


def candidate_order(commits: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Newest first: by step, then by attempt."""
    return sorted(set(commits), key=lambda sa: (sa[0], sa[1]), reverse=True)


def uncommitted_state(age_seconds: float, grace_seconds: float) -> SaveState:
    return SaveState.IN_PROGRESS if age_seconds < grace_seconds else SaveState.PARTIAL


@dataclass(frozen=True)
class SaveRef:
    """A committed save: what ``latest_complete()`` returns and ``read()`` takes."""

    run_id: str
    step: int
    attempt: int
    save_id: str
    record: CommitRecord
    manifest_digest: str
    #: where the save is read from in a tiered store: ``"durable"`` (the
    #: default, and the only tier of a plain store), ``"local"`` (committed
    #: in the local tier, not yet durable) or ``"both"`` (read locally, the
    #: durable copy the fallback). Not part of the record.
    tier: str = "durable"

    @classmethod
    def of(cls, rec: CommitRecord) -> SaveRef:
        return cls(rec.run_id, rec.step, rec.attempt, rec.save_id, rec, rec.manifest_digest())

    @property
    def components(self) -> dict[str, ComponentEntry]:
        return self.record.components

    @property
    def metadata(self) -> dict[str, object]:
        return self.record.metadata

    @property
    def total_bytes(self) -> int:
        return self.record.total_bytes

    def to_json(self, *, detail: bool = False) -> dict[str, Any]:
        """The save as plain JSON: step, attempt, save ID and manifest digest;
        with ``detail=True`` also its bytes, components and metadata (what
        ``ckptstore latest --json`` prints)."""
        out: dict[str, Any] = {"step": self.step, "attempt": self.attempt, "save_id": self.save_id,
                               "manifest_digest": self.manifest_digest}
        if self.tier != "durable":
            out["tier"] = self.tier
        if detail:
            out["bytes"] = self.total_bytes
            out["components"] = {n: c.to_json() for n, c in sorted(self.components.items())}
            out["metadata"] = self.metadata
        return out


@dataclass(frozen=True)
class Selection:
    """The answer of ``latest_complete(explain=True)``: the selected save, every
    newer candidate skipped with its reason (at most :data:`MAX_REPORTED_SKIPS`;
    ``more_skipped`` counts the rest), notes for an operator (unreadable
    attempt records, junk names), and ``unusable``: how many candidate records
    were read and could not be selected (candidates skipped by name are not
    counted: they are not in the run's history)."""

    latest: SaveRef | None
    skipped: list[Skip]
    more_skipped: int = 0
    notes: tuple[str, ...] = ()
    unusable: int = 0


@dataclass(frozen=True)
class SaveInfo:
    """One save as listed by ``list_saves()``."""

    save_id: str
    step: int
    attempt: int
    state: SaveState
    detail: str
    bytes: int
    components: int
    created_at: float | None
    selected: bool = False
    ref: SaveRef | None = None
    #: committed saves: bytes the save wrote itself (its own components and
    #: the pieces it holds) and bytes its record names in all (§9)
    bytes_written: int | None = None
    bytes_referenced: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "bytes_written": self.bytes_written,
            "bytes_referenced": self.bytes_referenced,
            "save_id": self.save_id,
            "step": self.step,
            "attempt": self.attempt,
            "state": self.state.value,
            "detail": self.detail,
            "bytes": self.bytes,
            "components": self.components,
            "created_at": self.created_at,
            "selected": self.selected,
            "manifest_digest": self.ref.manifest_digest if self.ref else None,
            **({"tier": self.ref.tier} if self.ref is not None and self.ref.tier != "durable" else {}),
        }


def bound_skips(skipped: list[Skip]) -> tuple[list[Skip], int]:
    """Newest first, cut to :data:`MAX_REPORTED_SKIPS` (and how many were cut)."""
    skipped = sorted(skipped, key=lambda k: (k.step, k.attempt), reverse=True)
    return skipped[:MAX_REPORTED_SKIPS], max(0, len(skipped) - MAX_REPORTED_SKIPS)
