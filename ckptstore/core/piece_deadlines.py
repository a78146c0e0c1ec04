"""What a part of a save must still satisfy when another process publishes
it (PROTOCOL.md §9.4, "Many processes, one save"): a rank's reported
deadlines (:class:`PieceDeadline`), the coordinator's checks of them
(:func:`check_deadlines`, :func:`check_rank_anchors`), and what a writer's
publication may rely on (:class:`Publication`). Pure but for the injected
clock and sleep of :class:`~ckptstore.core.intents.PieceTiming`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import SaveAbortedError
from .intents import PieceTiming


@dataclass(frozen=True)
class Publication:
    """What :meth:`PieceWriter.publishing` tells a publication: whether its own
    save may rely on its anchor, and the (step, attempt) of the writer's anchor
    while it holds (None: it does not)."""

    anchored: bool
    anchor_key: tuple[int, int] | None


@dataclass(frozen=True)
class PieceDeadline:
    """What one process's part of a save must still satisfy when another
    process (the coordinator) publishes it (§9.4): the save began at
    ``started_at`` and the intent it relies on (if any) expires at
    ``intent_expires_at`` (epoch seconds). ``anchor``: the part relied, without
    waiting for its intent, on the pieces of the commit (step, attempt) it
    learned last (§9.4 "The anchor"); ``intent_landed_at``: when its intent
    naming them landed (epoch seconds), for the coordinator to wait on when
    that commit is no longer the newest."""

    started_at: float
    intent_expires_at: float | None
    anchor: tuple[int, int] | None = None
    intent_landed_at: float | None = None

    def to_json(self) -> dict[str, object]:
        return {"started_at": self.started_at, "intent_expires_at": self.intent_expires_at,
                "anchor": list(self.anchor) if self.anchor is not None else None,
                "intent_landed_at": self.intent_landed_at}

    @classmethod
    def from_json(cls, d: object) -> PieceDeadline:
        """Strict: a malformed report is a :class:`SaveAbortedError` (nothing is published on it)."""

        def time_or_none(v: object) -> float | None:
            assert v is None or (isinstance(v, int | float) and not isinstance(v, bool))
            return None if v is None else float(v)

        try:
            assert isinstance(d, dict) and set(d) == {"started_at", "intent_expires_at", "anchor", "intent_landed_at"}
            start = time_or_none(d["started_at"])
            assert start is not None
            a = d["anchor"]
            assert a is None or (isinstance(a, list) and len(a) == 2
                                 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in a))
            return cls(start, time_or_none(d["intent_expires_at"]), None if a is None else (a[0], a[1]),
                       time_or_none(d["intent_landed_at"]))
        except AssertionError:
            raise SaveAbortedError(f"a rank's piece deadline report is malformed: {str(d)[:200]}; "
                                   "nothing was published") from None


def check_deadlines(deadlines: Mapping[int, PieceDeadline], timing: PieceTiming, save_id: str) -> None:
    """§9.4 steps 1-2 at a coordinator's publish, for every rank's reported
    part: no part began more than ``intent_ttl - window`` ago, and no intent a
    part relies on expires within the window. Otherwise :class:`SaveAbortedError`."""
    now = timing.clock()
    for rank, d in sorted(deadlines.items()):
        if now - d.started_at > timing.intent_ttl - timing.window:
            raise SaveAbortedError(f"save {save_id}: rank {rank}'s part took longer than its pieces are protected "
                                   f"({timing.intent_ttl:.0f}s less the {timing.window:.0f}s window); "
                                   "nothing was published")
        if d.intent_expires_at is not None and now > d.intent_expires_at - timing.window:
            raise SaveAbortedError(f"save {save_id}: the save intent rank {rank} relies on expired; nothing was published")


def check_rank_anchors(deadlines: Mapping[int, PieceDeadline], anchor: tuple[int, int] | None, timing: PieceTiming,
                       save_id: str) -> None:
    """At the coordinator's commit, inside its :meth:`PieceWriter.publishing`
    (``anchor``: its anchor's (step, attempt) while it holds): a rank's part
    that relied on its anchor without waiting is protected when that anchor
    is the coordinator's, the newest commit of the attempt (every gc keeps
    it). Otherwise the part relied on its intent after all: the commit waits
    until that intent is ``window`` old by this clock, and refuses one that
    never landed or expires within the window (:class:`SaveAbortedError`)."""
    late = {r: d for r, d in sorted(deadlines.items()) if d.anchor is not None and d.anchor != anchor}
    for r, d in late.items():
        if d.intent_landed_at is None or d.intent_expires_at is None:
            raise SaveAbortedError(f"save {save_id}: rank {r}'s part relied on the pieces of step {d.anchor[0]}, "  # type: ignore[index]
                                   "which is no longer the newest commit, and no save intent names them; "
                                   "nothing was published")
    if late:
        wait = max(d.intent_landed_at or 0.0 for d in late.values()) + timing.window - timing.clock()
        if wait > 0:
            timing.sleep(wait)
        now = timing.clock()
        for r, d in late.items():
            if d.intent_expires_at is not None and now > d.intent_expires_at - timing.window:
                raise SaveAbortedError(f"save {save_id}: the save intent rank {r} relies on expired; nothing was published")
