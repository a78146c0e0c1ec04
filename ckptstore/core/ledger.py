"""The run's append-only event ledger (interruptions, budget, operator notes).

Entries are created exclusively and never overwritten. Reading treats them as
input: malformed or forged entries are skipped and counted, never raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptionError, InvalidInputError, NotFoundError
from ..protocol import EventRecord, canonical_json, event_name, events_prefix, now, parse_event_name
from ..protocol.records import MAX_EVENT_RECORD
from .bounded_io import RunIO
from .record_auth import RecordAuth

#: Entries read at most (a ledger stuffed with junk cannot make a report read without bound).
MAX_EVENTS = 100_000


@dataclass(frozen=True)
class LedgerRead:
    events: list[EventRecord]
    #: entries skipped: unreadable, malformed, or beyond MAX_EVENTS
    skipped: int


class Ledger:
    def __init__(self, io: RunIO, auth: RecordAuth) -> None:
        self.io = io
        self.auth = auth

    def append(self, kind: str, payload: Mapping[str, Any], attempt: int | None) -> str:
        """Create one entry (visible on return; its name's durability is not
        waited for, PROTOCOL.md §7.2); returns its key."""
        ts = now()
        rec = EventRecord(kind, ts, attempt, dict(payload), version=self.io.layout.version)
        try:
            rec = self.auth.seal(rec, self.io.run_id)
            data = rec.encode()
            canonical_json(dict(payload))
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"event payload must be JSON-representable: {exc}") from None
        key = events_prefix(self.io.run_id) + event_name(int(ts * 1e6), kind)
        # lazy: nothing about selection or gc depends on an entry (PROTOCOL.md §2.4, §7.2); a power
        # loss may drop the newest entries, never tear one
        self.io.create(key, data, what="event", lazy=True)
        return key

    def read(self) -> LedgerRead:
        """Every readable entry, oldest first."""
        out: list[EventRecord] = []
        skipped = 0
        prefix = events_prefix(self.io.run_id)
        listed = self.io.list(prefix, flat=True)
        for i, o in enumerate(sorted(listed, key=lambda o: o.key)):
            # the canonical name, directly under events/ (never a sub-folder's key)
            if i >= MAX_EVENTS or parse_event_name(o.key[len(prefix) :]) is None:
                skipped += 1
                continue
            try:
                ev = EventRecord.decode(self.io.get_bounded(o.key, MAX_EVENT_RECORD), self.io.where(o.key))
            except (NotFoundError, CorruptionError):
                skipped += 1
                continue
            if self.auth.judge(ev, self.io.run_id, self.io, o.key) is not None:
                skipped += 1
                continue
            out.append(ev)
        return LedgerRead(out, skipped)
