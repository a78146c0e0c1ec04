"""Pure garbage-collection planning (invariant 4). No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .selection import SaveInfo, SaveState


@dataclass
class GcPlan:
    keep: list[SaveInfo] = field(default_factory=list)
    delete: list[tuple[SaveInfo, str]] = field(default_factory=list)


def plan_gc(infos: Sequence[SaveInfo], *, keep_last: int, keep_every: int | None = None) -> GcPlan:
    """Decide, for each listed save, keep or delete.

    * committed (verified) saves: the ``keep_last`` newest are kept — always at
      least the newest, which is the one ``latest_complete()`` returns — and,
      with ``keep_every=N``, every one whose step is a multiple of N;
    * superseded saves: deleted (no future resume can select them);
    * partial saves (uncommitted, older than the grace period): deleted;
    * in-progress saves (uncommitted, younger than the grace period): kept;
    * corrupt and unsupported-version saves: kept, for an operator to inspect;
    * a save ID that anything kept names is never deleted, whatever else
      names it (a forged record cannot point gc at a kept save's bytes).
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    if keep_every is not None and keep_every < 1:
        raise ValueError("keep_every must be >= 1")
    plan = GcPlan()
    complete_seen = 0
    for info in sorted(infos, key=lambda i: (i.step, i.attempt), reverse=True):
        if info.state is SaveState.COMMITTED:
            complete_seen += 1
            if complete_seen <= keep_last or (keep_every is not None and info.step % keep_every == 0):
                plan.keep.append(info)
            else:
                plan.delete.append((info, f"older than the {keep_last} newest complete save(s)"))
        elif info.state is SaveState.SUPERSEDED:
            plan.delete.append((info, f"superseded: {info.detail}"))
        elif info.state is SaveState.PARTIAL:
            plan.delete.append((info, "uncommitted and older than the grace period"))
        else:
            plan.keep.append(info)
    kept_ids = {i.save_id for i in plan.keep}
    plan.delete = [(i, r) for i, r in plan.delete if i.save_id not in kept_ids]
    return plan
