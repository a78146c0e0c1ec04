"""The replicator's save intent in the durable tier (PROTOCOL.md §"Tiers",
"Pieces and replication"): what protects the durable pieces a replication of
a version-3 save relies on from a durable gc running at the same time.

The replicator keeps, in memory, the pieces of the newest save it made
durable (or resumed from the durable tier) and a *standing intent* naming
them, written right after that commit, so that the next replication finds it
old enough to rely on (§9.4: a writer relies on an intent only ``window``
after it landed) and uploads only the pieces the durable tier lacks, with no
listing per piece. When the intent does not cover what a save reuses, or is
past half its lifetime, or a try failed, a new intent naming every piece of
the save is written first, waited for, and the durable tier's holders are
listed (one listing per holder) to learn what is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..core.bounded_io import RunIO
from ..core.intents import RENEW_SHARE, PieceTiming
from ..core.piece_evidence import MAX_HOLDER_LISTINGS, list_holders
from ..errors import SaveAbortedError
from ..protocol import CommitRecord
from ..protocol.layout import new_intent_key
from ..protocol.records import IntentRecord

Names = dict[tuple[str, str], int]


@dataclass
class _Armed:
    key: str
    record: IntentRecord
    #: ``time.monotonic()`` when its create returned
    landed: float


class DurableIntent:
    """One replicator's intent in the durable tier and the pieces it knows
    the durable tier holds. Used by one replication thread at a time."""

    def __init__(self, io: RunIO, attempt: int, timing: PieceTiming) -> None:
        self.io, self.attempt, self.timing = io, attempt, timing
        #: (holder, digest) -> size of the pieces of the newest durable commit this replicator knows
        self.known: Names = {}
        self.armed: _Armed | None = None
        #: a try failed or the knowledge is doubtful: the next one writes a fresh intent and lists
        self.doubtful = False
        #: the last :meth:`protect` returned pieces to skip (the intent must outlive the commit)
        self.relying = False
        #: listings of the durable tier's piece holders made (tests count them)
        self.listings = 0

    def _arm(self, names: set[tuple[str, str]]) -> None:
        """Write an intent naming ``names``, then remove the previous one (best effort)."""
        old = self.armed
        self.armed = None
        if names:
            t = self.timing.clock()
            rec = IntentRecord(self.io.run_id, self.attempt, t, t + self.timing.intent_ttl, tuple(sorted(names)),
                               version=self.io.layout.version)
            key = new_intent_key(self.io.run_id, self.attempt)
            self.io.create(key, rec.encode(), what="save intent")
            self.armed = _Armed(key, rec, time.monotonic())
        if old is not None:
            try:
                self.io.delete(old.key)
            except Exception:  # noqa: BLE001 - an old intent only keeps pieces a while longer
                pass

    def learn(self, rec: CommitRecord) -> None:
        """``rec`` is committed in the durable tier: its pieces are the ones the
        next replication may skip; the standing intent is rewritten to name them
        (best effort: without it the next replication writes one and waits)."""
        self.known = rec.piece_refs()
        self.doubtful = False
        try:
            self._arm(set(self.known))
        except Exception:  # noqa: BLE001 - the next replication arms its own
            self.armed = None

    def forget(self) -> None:
        """A try failed: trust nothing in memory on the next one."""
        self.doubtful = True

    def _covers(self, names: set[tuple[str, str]]) -> bool:
        a = self.armed
        return (a is not None and names <= set(a.record.pieces)
                and self.timing.clock() <= a.record.created_at + RENEW_SHARE * self.timing.intent_ttl)

    def _wait_window(self) -> None:
        assert self.armed is not None
        wait = self.armed.landed + self.timing.window - time.monotonic()
        if wait > 0:
            self.timing.sleep(wait)

    def protect(self, rec: CommitRecord, *, every: bool = False) -> Names:
        """Before a replication of ``rec`` uploads anything: the pieces of
        ``rec`` it may skip (the durable tier holds them and a live intent at
        least ``window`` old names them). From memory when the standing intent
        covers them, else after a fresh intent naming every piece of ``rec``
        (waited for) and one listing per holder.

        ``every``: the caller commits pieces other processes upload (the
        coordinator of many ranks, ``tiers.parts``): the intent must name
        *every* piece of ``rec``, not only those skipped, be ``window`` old
        when this returns, and :meth:`check_live` then requires it live."""
        need = rec.piece_refs()
        reuse = {hd for hd, size in need.items() if self.known.get(hd) == size}
        # a piece under another save's ID that is not skipped is uploaded under that ID: the
        # durable gc may sweep it at any age once it read that save's commit (§9.5 step 5), so
        # an intent must name it too (§9.6 step 2)
        foreign = {hd for hd in need if hd[0] != rec.save_id}
        guard = set(need) if every else reuse | foreign
        if not self.doubtful and (not guard or self._covers(guard)):
            if guard:
                self._wait_window()
            self.relying = bool(guard)
            return {hd: need[hd] for hd in reuse}
        self._arm(set(need))
        self._wait_window()
        holders = {h for h, _ in need}
        self.listings += min(len(holders), MAX_HOLDER_LISTINGS + 1)
        there: Names = {hd: p.size for hd, p in list_holders(self.io, holders).items()}
        self.doubtful = False
        have = {hd: size for hd, size in need.items() if there.get(hd) == size}
        self.relying = bool(have) or bool(foreign) or (every and bool(need))
        return have

    def check_live(self, rec: CommitRecord, started: float) -> None:
        """Just before the durable commit of ``rec``: the intent that protects
        what it reuses is still live for at least ``window`` and the
        replication ran shorter than an intent lives (less the window);
        :class:`SaveAbortedError` otherwise (nothing is committed; retried)."""
        t = self.timing
        if time.monotonic() - started > t.intent_ttl - t.window:
            self.forget()
            raise SaveAbortedError(f"replication of step {rec.step} took longer than its pieces are protected; "
                                   "not committed (retried)")
        a = self.armed
        if self.relying and (a is None or t.clock() > a.record.expires_at - t.window):
            self.forget()
            raise SaveAbortedError(f"replication of step {rec.step}: its save intent in the durable tier expired; "
                                   "not committed (retried)")

    def close(self) -> None:
        """Remove the standing intent (best effort: one left behind expires)."""
        a, self.armed = self.armed, None
        if a is not None:
            try:
                self.io.delete(a.key)
            except Exception:  # noqa: BLE001 - it expires on its own
                pass
