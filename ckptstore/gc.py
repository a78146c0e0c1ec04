"""Pure garbage-collection planning (invariant 4). No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .selection import SaveState


@dataclass
class GcPlan:
    keep: list = field(default_factory=list)  # list[SaveInfo]
    delete: list = field(default_factory=list)  # list[tuple[SaveInfo, str]]


def plan_gc(infos: Sequence, *, keep_last: int) -> GcPlan:
    """Decide, for each listed save (newest first), keep or delete.

    * committed (verified) saves: the ``keep_last`` newest are kept — always at
      least the newest, which is the one ``latest_complete()`` returns;
    * superseded saves: deleted (no future resume can select them);
    * partial saves (uncommitted, older than the grace period): deleted;
    * in-progress saves (uncommitted, younger than the grace period): kept;
    * corrupt and unsupported-version saves: kept, for an operator to inspect.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    plan = GcPlan()
    complete_seen = 0
    for info in sorted(infos, key=lambda i: (i.step, i.attempt), reverse=True):
        if info.state is SaveState.COMMITTED:
            complete_seen += 1
            if complete_seen <= keep_last:
                plan.keep.append(info)
            else:
                plan.delete.append((info, f"older than the {keep_last} newest complete save(s)"))
        elif info.state is SaveState.SUPERSEDED:
            plan.delete.append((info, f"superseded: {info.detail}"))
        elif info.state is SaveState.PARTIAL:
            plan.delete.append((info, "uncommitted and older than the grace period"))
        else:
            plan.keep.append(info)
    return plan
