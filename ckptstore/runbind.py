"""Binding a run ID to its identity (PROTOCOL.md §4.1): ``RUN.json`` is
created exclusively once and compared field by field on every open."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .authn import RecordAuth
from .errors import CorruptionError, IdentityMismatchError, NotFoundError
from .identity import diff_identity, identity_digest
from .protocol import RUN_RECORD, RunRecord, now, run_record_key
from .protocol.records import MAX_RUN_RECORD
from .runio import RunIO


def read_run_record(io: RunIO, auth: RecordAuth | None = None) -> RunRecord:
    key = run_record_key(io.run_id)
    try:
        data = io.get_bounded(key, MAX_RUN_RECORD)
    except NotFoundError:
        raise NotFoundError(
            f"run {io.run_id!r} does not exist at {io.backend.url} (no {RUN_RECORD}); "
            "open it with an identity to create it"
        ) from None
    rec = RunRecord.decode(data, io.where(key), run_id=io.run_id)
    why = auth.judge(rec, io.run_id, io, key) if auth is not None else None
    if why is not None:
        raise CorruptionError(
            f"{io.where(key)}: the run record is {why}; under auth_policy='require' only authenticated runs are "
            "opened (sign an existing run with `ckptstore sign`)"
        )
    return rec


def check_identity(run_id: str, stored: Mapping[str, Any], requested: Mapping[str, Any]) -> None:
    diff = diff_identity(stored, requested)
    if diff:
        raise IdentityMismatchError(run_id, list(diff), diff)


def bind_identity(
    io: RunIO, requested: dict[str, Any], lineage: Mapping[str, Any] | None, auth: RecordAuth
) -> dict[str, Any]:
    """Create the run record, or check the existing one; the identity in force."""
    rec = RunRecord(io.run_id, requested, identity_digest(requested), now(), dict(lineage) if lineage else None)
    if io.create(run_record_key(io.run_id), auth.seal(rec, io.run_id).encode(), what="run identity record"):
        return requested
    stored = read_run_record(io, auth).identity
    check_identity(io.run_id, stored, requested)
    return dict(stored)


def read_identity(io: RunIO, requested: dict[str, Any] | None, auth: RecordAuth) -> dict[str, Any]:
    stored = dict(read_run_record(io, auth).identity)
    if requested is not None:
        check_identity(io.run_id, stored, requested)
    return stored
