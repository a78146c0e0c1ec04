"""Retention: which complete saves a run keeps. A pure decision, no I/O.

The rules are gc's (PROTOCOL.md invariant 4) plus ``keep_every``:

* the newest complete save is always kept (``latest_complete()`` returns it);
* the ``keep_last`` newest complete saves are kept;
* with ``keep_every=N``, every complete save whose ``step % N == 0`` is kept;
* other complete saves are deleted; everything else (in-progress, corrupt,
  unsupported, superseded, partial) is left to ``CheckpointStore.gc``'s own
  rules.

The Checkpointer carries them out after each commit with
``store.gc(keep_last=..., keep_every=...)``; the decision itself is gc's,
:func:`ckptstore.protocol.gcplan.plan_gc`.
"""

from __future__ import annotations

from .. import InvalidInputError


def validate(keep_last: int | None, keep_every: int | None) -> None:
    if keep_last is not None and keep_last < 1:
        raise InvalidInputError("keep_last must be at least 1: the newest complete save is never deleted")
    if keep_every is not None and keep_every < 1:
        raise InvalidInputError("keep_every must be at least 1")
    if keep_every is not None and keep_last is None:
        raise InvalidInputError("keep_every needs keep_last (how many of the newest saves to keep besides)")
