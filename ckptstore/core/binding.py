"""Binding a run ID to its identity (PROTOCOL.md §4.1): ``RUN.json`` is
created exclusively once and compared field by field on every open. Its
protocol version fixes the run's layout for good (§1.1): reading or creating
it sets ``io.layout``, which every later key and record of the run follows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CorruptionError, IdentityMismatchError, InvalidInputError, NotFoundError
from ..identity import diff_identity, identity_digest
from ..protocol import LATEST_LAYOUT, RUN_RECORD, Layout, RunRecord, layout_of, now, run_record_key
from ..protocol.records import MAX_RUN_RECORD
from .bounded_io import RunIO
from .record_auth import RecordAuth


def read_run_record(io: RunIO, auth: RecordAuth | None = None) -> RunRecord:
    key = run_record_key(io.run_id)
    try:
        data = io.get_bounded(key, MAX_RUN_RECORD)
    except NotFoundError:
        raise NotFoundError(
            f"run {io.run_id!r} does not exist at {io.backend.url} (no {RUN_RECORD}); "
            "open it with an identity to create it"
        ) from None
    rec = RunRecord.decode(data, io.where(key), run_id=io.run_id)  # a newer version: UnsupportedVersion, not opened
    why = auth.judge(rec, io.run_id, io, key) if auth is not None else None
    if why is not None:
        raise CorruptionError(
            f"{io.where(key)}: the run record is {why}; under auth_policy='require' only authenticated runs are "
            "opened (sign an existing run with `ckptstore sign`)"
        )
    io.layout_or_none = layout_of(rec.version)
    return rec


def check_version(io: RunIO, wanted: Layout | None) -> None:
    """An existing run keeps the version it was created with: asking for another is refused."""
    if wanted is not None and io.layout.version != wanted.version:
        raise InvalidInputError(
            f"run {io.run_id!r} uses protocol version {io.layout.version}, not {wanted.version} as asked; "
            "a run keeps the version it was created with (start a new run ID for another)"
        )


def check_identity(run_id: str, stored: Mapping[str, Any], requested: Mapping[str, Any]) -> None:
    diff = diff_identity(stored, requested)
    if diff:
        raise IdentityMismatchError(run_id, list(diff), diff)


def bind_identity(
    io: RunIO,
    requested: dict[str, Any],
    lineage: Mapping[str, Any] | None,
    auth: RecordAuth,
    version: Layout | None = None,
) -> dict[str, Any]:
    """Create the run record (with ``version``'s layout, default the latest),
    or check the existing one; the identity in force."""
    layout = version or LATEST_LAYOUT
    rec = RunRecord(
        io.run_id, requested, identity_digest(requested), now(), dict(lineage) if lineage else None,
        version=layout.version,
    )
    if io.create(run_record_key(io.run_id), auth.seal(rec, io.run_id).encode(), what="run identity record"):
        io.layout_or_none = layout
        return requested
    stored = read_run_record(io, auth).identity
    check_identity(io.run_id, stored, requested)
    check_version(io, version)
    return dict(stored)


def read_identity(
    io: RunIO, requested: dict[str, Any] | None, auth: RecordAuth, version: Layout | None = None
) -> dict[str, Any]:
    stored = dict(read_run_record(io, auth).identity)
    if requested is not None:
        check_identity(io.run_id, stored, requested)
    check_version(io, version)
    return stored
