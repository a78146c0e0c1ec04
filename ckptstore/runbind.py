"""Binding a run ID to its identity (PROTOCOL.md §4.1): ``RUN.json`` is
created exclusively once and compared field by field on every open."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import IdentityMismatchError, NotFoundError
from .identity import diff_identity, identity_digest
from .protocol import RUN_RECORD, RunRecord, now, run_record_key
from .protocol.records import MAX_RUN_RECORD
from .runio import RunIO


def read_run_record(io: RunIO) -> RunRecord:
    key = run_record_key(io.run_id)
    try:
        data = io.get_bounded(key, MAX_RUN_RECORD)
    except NotFoundError:
        raise NotFoundError(
            f"run {io.run_id!r} does not exist at {io.backend.url} (no {RUN_RECORD}); "
            "open it with an identity to create it"
        ) from None
    return RunRecord.decode(data, io.where(key), run_id=io.run_id)


def check_identity(run_id: str, stored: Mapping[str, Any], requested: Mapping[str, Any]) -> None:
    diff = diff_identity(stored, requested)
    if diff:
        raise IdentityMismatchError(run_id, list(diff), diff)


def bind_identity(io: RunIO, requested: dict[str, Any], lineage: Mapping[str, Any] | None) -> dict[str, Any]:
    """Create the run record, or check the existing one; the identity in force."""
    rec = RunRecord(io.run_id, requested, identity_digest(requested), now(), dict(lineage) if lineage else None)
    if io.create(run_record_key(io.run_id), rec.encode(), what="run identity record"):
        return requested
    stored = read_run_record(io).identity
    check_identity(io.run_id, stored, requested)
    return dict(stored)


def read_identity(io: RunIO, requested: dict[str, Any] | None) -> dict[str, Any]:
    stored = dict(read_run_record(io).identity)
    if requested is not None:
        check_identity(io.run_id, stored, requested)
    return stored
