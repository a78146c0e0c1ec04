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

from .protocol import AttemptRecord


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


def same_step_winner(commits: Iterable[tuple[int, int]]) -> dict[int, int]:
    """For each step, the highest attempt that committed it."""
    best: dict[int, int] = {}
    for s, a in commits:
        if a > best.get(s, -1):
            best[s] = a
    return best


def uncommitted_state(age_seconds: float, grace_seconds: float) -> SaveState:
    return SaveState.IN_PROGRESS if age_seconds < grace_seconds else SaveState.PARTIAL
