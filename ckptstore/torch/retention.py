"""Retention: which complete saves a run keeps. A pure decision, no I/O.

The rules are gc's (PROTOCOL.md invariant 4) plus ``keep_every``:

* the newest complete save is always kept (``latest_complete()`` returns it);
* the ``keep_last`` newest complete saves are kept;
* with ``keep_every=N``, every complete save whose ``step % N == 0`` is kept;
* other complete saves are deleted; everything else (in-progress, corrupt,
  unsupported, superseded, partial) is left to ``CheckpointStore.gc``'s own
  rules.

``CheckpointStore.gc`` takes ``keep_last`` only. The Checkpointer carries out
``keep_last`` with ``store.gc(keep_last=...)``; ``keep_every`` needs the core
hook ``gc(keep_last=K, keep=predicate)`` (a complete save for which
``predicate(info)`` is true is kept beside the ``keep_last`` newest), to which
:func:`keep_predicate` is passed once it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import InvalidInputError, SaveState


@dataclass
class RetentionPlan:
    keep: list[Any] = field(default_factory=list)  # SaveInfo
    delete: list[tuple[Any, str]] = field(default_factory=list)  # (SaveInfo, reason)


def validate(keep_last: int | None, keep_every: int | None) -> None:
    if keep_last is not None and keep_last < 1:
        raise InvalidInputError("keep_last must be at least 1: the newest complete save is never deleted")
    if keep_every is not None and keep_every < 1:
        raise InvalidInputError("keep_every must be at least 1")
    if keep_every is not None and keep_last is None:
        raise InvalidInputError("keep_every needs keep_last (how many of the newest saves to keep besides)")


def keep_predicate(keep_every: int | None) -> Callable[[Any], bool]:
    """The extra keep rule beside ``keep_last``: ``step % keep_every == 0``."""
    return lambda info: keep_every is not None and info.step % keep_every == 0


def plan_retention(infos: Sequence[Any], *, keep_last: int, keep_every: int | None = None) -> RetentionPlan:
    """Decide for each complete save (``SaveInfo`` with state COMMITTED) keep or
    delete; other saves are kept here (gc has its own rules for them)."""
    validate(keep_last, keep_every)
    extra = keep_predicate(keep_every)
    plan = RetentionPlan()
    seen = 0
    for info in sorted(infos, key=lambda i: (i.step, i.attempt), reverse=True):
        if info.state is not SaveState.COMMITTED:
            plan.keep.append(info)
            continue
        seen += 1
        if seen <= keep_last or extra(info):
            plan.keep.append(info)
        else:
            plan.delete.append((info, f"older than the {keep_last} newest complete save(s)"
                                      + (f" and step not a multiple of {keep_every}" if keep_every else "")))
    return plan
