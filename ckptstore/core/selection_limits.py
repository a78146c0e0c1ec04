"""What selection may conclude without reading, and what it must not
conclude when it cannot (PROTOCOL.md §4.4 step 2, THREATS.md §4.2).

Candidates whose state follows from their name and the attempt records are
skipped by name: not read, not counted against ``MAX_CANDIDATES``. Reaching
the bound is an error naming the cause and the way out, never "no save".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..errors import LimitReachedError
from ..protocol.selection import MAX_REPORTED_SKIPS, Skip, SkipReason, describe_superseder, superseded_by
from .fencing import AttemptView

#: the reasons of candidates skipped by name (in ``select``, no record read gets them)
BY_NAME = (SkipReason.UNREGISTERED_ATTEMPT, SkipReason.SUPERSEDED)


class NameSkips:
    """The candidates selection skips by name: made by an attempt that was
    never registered, or superseded by a later registered attempt (§5). Their
    state follows from the name and the attempt records, so their records are
    not read and they do not count against the candidate bound (a rolled-back
    run's thousand superseded commits cost a listing, never the selection).
    Kept: the first :data:`MAX_REPORTED_SKIPS` as skips, the count, and (with
    ``keep_names``: the ``explain`` report needs them) the names."""

    def __init__(self, view: AttemptView, *, keep_names: bool = False) -> None:
        self.view = view
        self.keep_names = keep_names
        self.skips: list[Skip] = []
        self.count = 0
        self.names: set[tuple[int, int]] = set()

    def reason(self, step: int, attempt: int) -> tuple[SkipReason, str] | None:
        if attempt not in self.view.records and attempt not in self.view.unreadable:
            return SkipReason.UNREGISTERED_ATTEMPT, f"made by attempt {attempt}, which was never registered (record not read)"
        later = superseded_by(step, attempt, self.view.effective)
        if later is not None:
            return SkipReason.SUPERSEDED, f"{describe_superseder(later)} (record not read)"
        return None

    def filter(self, order: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
        """``order`` without the candidates skipped by name (recorded here)."""
        for step, attempt in order:
            why = self.reason(step, attempt)
            if why is None:
                yield step, attempt
                continue
            self.count += 1
            if self.keep_names:
                self.names.add((step, attempt))
            if len(self.skips) < MAX_REPORTED_SKIPS:
                self.skips.append(Skip(step, attempt, None, why[0], why[1]))


def describe(skipped: Iterable[Skip], n: int, width: int) -> str:
    """The first ``n`` candidates read and rejected, for a message."""
    return "; ".join(
        f"step {k.step} attempt {k.attempt}: {k.reason.value}: {k.detail[:width]}"
        for k in [k for k in skipped if k.reason not in BY_NAME][:n]
    )


def gave_up(run_id: str, bound: int, skipped: list[Skip], by_name: int) -> LimitReachedError:
    """The error when ``bound`` candidate records were read, newest first, and
    none can be selected (``skipped``: them, newest first): selection gave up."""
    return LimitReachedError(
        f"run {run_id!r}: selection gave up: the {bound} newest candidate commit records it read (steps "
        f"{skipped[-1].step}..{skipped[0].step}; {by_name} superseded or unregistered ones skipped by name) "
        f"cannot be used ({describe(skipped, 3, 120)}), and older ones were not tried. This is not \"no save\": "
        "nothing was selected and no attempt was registered. `ckptstore ls` lists every commit with its state; "
        "remove the records that are not yours, or open the writer with an explicit resume point "
        "(resume_from=<step> of a save you trust, or resume_from=None to start over deliberately)."
    )
