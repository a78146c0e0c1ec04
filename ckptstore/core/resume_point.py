"""The resume point of a writer opening with ``resume_from="latest"``
(PROTOCOL.md §4.2 step 2, THREATS.md §4.2): the selected save, None only
when the run's history holds no commit at all, and otherwise a refusal —
recorded in the ledger — rather than a fresh start that would supersede the
run's saves; and the saves it falls back to when the resume point's bytes
turn out corrupt (:func:`fallback_candidates`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CkptStoreError, LimitReachedError, ResumeRefusedError
from ..protocol.selection import SaveInfo, SaveRef, SaveState
from .catalog import Catalog
from .fencing import AttemptView
from .ledger import Ledger
from .selection_limits import describe


def resume_point(
    catalog: Catalog, view: AttemptView, deep: bool, memo: set[str] | None, ledger: Ledger, writer_id: str
) -> SaveRef | None:
    """The save to resume from (``view``: the attempts to judge by). Raises
    :class:`LimitReachedError` when selection gave up and
    :class:`ResumeRefusedError` when the history has commits none of which
    can be selected; both are recorded as a ``resume-refused`` event (best
    effort) before anything is registered."""
    try:
        sel = catalog.select(deep, view, explain=False, memo=memo)
        if sel.latest is None and sel.unusable:
            raise ResumeRefusedError(
                f"run {catalog.io.run_id!r} has {sel.unusable} commit record(s) in its history and none can be "
                f"selected ({describe(sel.skipped, 3, 160)}); resuming from 'latest' would start over from step 0 "
                "and supersede them. Nothing was registered. Inspect them with `ckptstore ls` (and `ckptstore "
                "verify`): repair or remove the records that are not yours, or open the writer with an explicit "
                "resume point (resume_from=<step>, or resume_from=None to start over deliberately)."
            )
    except (ResumeRefusedError, LimitReachedError) as exc:
        try:
            ledger.append("resume-refused", {"writer_id": writer_id, "error": str(exc)[:2000]}, None)
        except CkptStoreError:
            pass  # the refusal itself is what the caller gets
        raise
    return sel.latest


def fallback_candidates(saves: Sequence[SaveInfo], below: SaveRef) -> list[SaveRef]:
    """The saves a resume falls back to when the bytes of ``below`` (the resume
    point) turn out corrupt: every committed save older than it (by step, then
    attempt), newest first, as ``saves`` (a listing, newest first) judges them —
    committed and not superseded, complete by size; the caller's verified read
    decides each. The one rule, for one process (``CheckpointStore.read_resume_point``)
    and for many ranks (``RankStore``), whatever tiers hold them."""
    return [i.ref for i in saves if i.state is SaveState.COMMITTED and i.ref is not None
            and (i.step, i.attempt) < (below.step, below.attempt)]
