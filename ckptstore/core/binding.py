"""Binding a run ID to its identity (PROTOCOL.md §4.1): ``RUN.json`` is
created exclusively once and compared field by field on every open. Its
protocol version fixes the run's layout for good (§1.1): reading or creating
it sets ``io.layout``, which every later key and record of the run follows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CorruptionError, IdentityMismatchError, InvalidInputError, NotFoundError, RunRecordMismatchError
from ..identity import diff_identity, identity_digest
from ..protocol import LATEST_LAYOUT, RUN_RECORD, Layout, RunRecord, layout_of, now, run_record_key
from ..protocol.layout import LAYOUT_V1, LAYOUT_V2, naming_versions
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
    create_as: Layout | None = None,
) -> dict[str, Any]:
    """Check the existing run record, or create it (with ``version``'s layout,
    else ``create_as``, else the default); the identity in force. An existing
    run must be of ``version`` when it is given (``create_as`` is only a default).

    Read first: an open of an existing run (every restart) reads the record
    and writes nothing (creating first cost it a temporary file, an fsync and
    a refused link on a local disk, a refused conditional PUT on S3 and GCS).
    A run that does not exist yet is created with the backend's create (a
    link, ``If-None-Match: *``, ``ifGenerationMatch=0``); the loser of two
    first opens reads the winner's record and is judged against it."""
    try:
        stored = read_run_record(io, auth).identity
    except NotFoundError:
        layout = version or create_as or LATEST_LAYOUT
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


def version_mismatch(
    io: RunIO, other: Mapping[tuple[int, int], str], stamped: Sequence[tuple[str, int]], stated: int | None = None,
) -> RunRecordMismatchError:
    """The refusal when the run record's protocol version disagrees with the
    run's commit records (THREATS.md §4.13): ``other`` are the commit names of
    the other naming (step, attempt -> key), ``stamped`` the records of the
    run's own naming that state another version (key, version), ``stated``
    the version the newest of ``other`` states, when it could be read. The
    message names both versions, the evidence and the fix."""
    version = io.layout.version
    evidence: list[str] = []
    back: str | None = None
    if other:
        newest = other[max(other)]
        naming = naming_versions(LAYOUT_V1 if io.layout.newest_first else LAYOUT_V2)
        said = f", whose record says protocol_version {stated}" if stated is not None else ""
        evidence.append(
            f"{len(other)} commit name(s) follow the naming of protocol version {naming}, not of version {version} "
            f"(newest: {io.where(newest)}{said})"
        )
        back = str(stated) if stated is not None else ("1" if io.layout.newest_first else "2 or 3")
    if stamped:
        counts: dict[int, int] = {}
        for _, v in stamped:
            counts[v] = counts.get(v, 0) + 1
        top = max(counts, key=lambda v: (counts[v], v))
        evidence.append(
            f"{len(stamped)} commit record(s) of its own naming state another protocol_version "
            f"({', '.join(f'{n} say {v}' for v, n in sorted(counts.items()))}; e.g. {io.where(stamped[0][0])})"
        )
        back = back or str(top)
    return RunRecordMismatchError(
        f"run {io.run_id!r}: its run record {io.where(run_record_key(io.run_id))} says protocol_version {version}, "
        f"but its commit records disagree and none of version {version} can be selected: {'; '.join(evidence)}. "
        "The run record was changed after the run was created (or these records were planted). Nothing was "
        f"selected, registered or deleted. Fix: if {RUN_RECORD} was edited, set its protocol_version back to {back} "
        "(or restore the file from a backup) and open the run again; if those records are not this run's, inspect "
        "and remove them by hand. Under auth_policy='require' an edited run record is refused when the run is opened."
    )
