"""Signing an existing run's records after the fact (``ckptstore sign``):
each save is re-hashed first, and only what verifies is signed. Tags go to
sidecar objects (records are immutable), see :mod:`ckptstore.authn`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .catalog import Catalog
from .errors import CorruptionError, NotFoundError
from .protocol import (
    AttemptRecord,
    EventRecord,
    attempt_key,
    attempt_of_key,
    attempts_prefix,
    events_prefix,
    run_record_key,
)
from .protocol.records import MAX_ATTEMPT_RECORD, MAX_EVENT_RECORD
from .runbind import read_run_record


@dataclass
class SignReport:
    signed: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    #: record key -> why it was not signed
    refused: dict[str, str] = field(default_factory=dict)


def sign_run(catalog: Catalog) -> SignReport:
    io, auth = catalog.io, catalog.auth
    rep = SignReport()

    def one(key: str, rec: object) -> None:
        from .protocol.records import Signable

        assert isinstance(rec, Signable)
        if auth.problem(rec, io.run_id, io, key) is None:
            rep.already.append(key)
        elif auth.sign_existing(io, key, rec):
            rep.signed.append(key)
        else:
            rep.refused[key] = "a different sidecar tag already exists"

    one(run_record_key(io.run_id), read_run_record(io))
    for o in io.list(attempts_prefix(io.run_id)):
        n = attempt_of_key(io.run_id, o.key)  # the canonical key only, never a twin
        if n is None:
            continue
        try:
            one(attempt_key(io.run_id, n), AttemptRecord.decode(io.get_bounded(o.key, MAX_ATTEMPT_RECORD), o.key))
        except (CorruptionError, NotFoundError) as exc:
            rep.refused[o.key] = str(exc)
    scan = catalog.scan()
    for step, attempt in sorted(scan.commits, reverse=True):
        key = catalog.commit_key(step, attempt)
        try:
            rec = catalog.load_commit(step, attempt)
        except (CorruptionError, NotFoundError) as exc:
            rep.refused[key] = str(exc)
            continue
        problems = catalog.check_components(rec, None, deep=True)
        if problems:
            rep.refused[key] = "; ".join(d for _, d in problems)
            continue
        one(key, rec)
    for o in io.list(events_prefix(io.run_id)):
        try:
            one(o.key, EventRecord.decode(io.get_bounded(o.key, MAX_EVENT_RECORD), o.key))
        except (CorruptionError, NotFoundError) as exc:
            rep.refused[o.key] = str(exc)
    return rep
