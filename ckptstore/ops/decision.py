"""The resume decision: resume / start fresh / new run required / stop.

One pure function over facts gathered from the store (no I/O), plus a helper
that gathers them. The order of the rules is the seeds' order:

1. budget spent (``spent >= limit``)          -> ``stop``  (budget-exhausted)
2. the run does not exist yet                 -> ``start-fresh``
3. identity differs (any field)               -> ``new-run-required`` (mismatched fields listed;
                                                  never resume under the old run ID)
4. no complete save (maybe only partial ones) -> ``start-fresh`` (the partial ones are listed as discarded)
5. otherwise                                  -> ``resume`` at ``step + 1`` from the newest complete
                                                  save; newer partial/corrupt/superseded candidates are
                                                  listed as discarded, with reasons.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..protocol.selection import Skip

__all__ = ["Action", "Decision", "decide", "plan_resume"]


class Action(str, enum.Enum):
    RESUME = "resume"
    START_FRESH = "start-fresh"
    NEW_RUN_REQUIRED = "new-run-required"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    #: the step training continues at (resume: saved step + 1; start-fresh: 0)
    next_step: int | None = None
    #: the save resumed from
    save_id: str | None = None
    saved_step: int | None = None
    mismatched_fields: list[str] = field(default_factory=list)
    discarded: list[Skip] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "reason": self.reason,
            "next_step": self.next_step,
            "save_id": self.save_id,
            "saved_step": self.saved_step,
            "mismatched_fields": self.mismatched_fields,
            "discarded": [s.to_json() for s in self.discarded],
        }


def decide(
    *,
    run_exists: bool,
    identity_diff: Mapping[str, tuple[Any, Any]] | None,
    latest_step: int | None,
    latest_save_id: str | None,
    skipped: list[Skip],
    spent: float | None = None,
    limit: float | None = None,
) -> Decision:
    """The decision from facts; see the module docstring for the rules."""
    if spent is not None and limit is not None and spent >= limit:
        return Decision(Action.STOP, f"budget-exhausted: spent {spent:.3f} of {limit:.3f}", discarded=skipped)
    if not run_exists:
        return Decision(Action.START_FRESH, "no-such-run", next_step=0)
    if identity_diff:
        fields = sorted(identity_diff)
        return Decision(
            Action.NEW_RUN_REQUIRED,
            "identity-changed: " + ", ".join(fields),
            mismatched_fields=fields,
        )
    if latest_step is None:
        reason = "partial-checkpoint: no complete save" if skipped else "no-checkpoint"
        return Decision(Action.START_FRESH, reason, next_step=0, discarded=skipped)
    return Decision(
        Action.RESUME,
        "complete-checkpoint",
        next_step=latest_step + 1,
        save_id=latest_save_id,
        saved_step=latest_step,
        discarded=skipped,
    )


def plan_resume(
    url: Any,
    run_id: str,
    identity: Any,
    *,
    spent: float | None = None,
    limit: float | None = None,
    deep: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Decision:
    """Gather the facts from the store (read-only; nothing is written) and decide."""
    from ..errors import NotFoundError
    from ..identity import diff_identity, normalize_identity
    from ..store import CheckpointStore

    requested = normalize_identity(identity)
    try:
        store = CheckpointStore.open(url, run_id, mode="r", storage_options=storage_options)
    except NotFoundError:
        return decide(run_exists=False, identity_diff=None, latest_step=None, latest_save_id=None, skipped=[],
                      spent=spent, limit=limit)
    diff = diff_identity(store.identity, requested)
    if diff:
        return decide(run_exists=True, identity_diff=diff, latest_step=None, latest_save_id=None, skipped=[],
                      spent=spent, limit=limit)
    sel = store.latest_complete(deep=deep, explain=True)
    return decide(
        run_exists=True,
        identity_diff=None,
        latest_step=sel.latest.step if sel.latest else None,
        latest_save_id=sel.latest.save_id if sel.latest else None,
        skipped=sel.skipped,
        spent=spent,
        limit=limit,
    )
