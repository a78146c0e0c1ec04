"""The record pack (PROTOCOL.md §4.7.1): a copy of a run's commit-record bytes
in one object, ``<run>/index/commits.json``, so that a listing of the run by
a process that holds none of its records reads one object on S3 instead of
one per record.

A cache, never a source of truth. An entry is used only for a commit that the
same walk listed, and only when its bytes are provably that listed object's:
their length is the listed size and their MD5 is the listed ETag (the
backend's ``version_is_md5``). So what the walk decodes and judges is exactly
what a read of the record would have returned; everything else in a pack —
entries for commits that do not exist, entries whose bytes differ, a pack of
another run, an oversize, unparsable or missing pack — is ignored and costs
only the reads it would have saved. The pack never names what to delete: gc
and the listing decide from the listing and the records, as without it.
Backends whose listing carries no content digest (a local disk, GCS, memory)
never read or write it.

A store opened for writing writes the pack (a plain overwrite, no
create-if-absent: any writer's complete copy will do) after a full walk when
at least :data:`MIN_NEW_RECORDS` of the records it holds are not in the pack
it last read or wrote (a long-lived writer's periodic full gc keeps it
current from its record cache); readers never write. A failed write is ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping

from ..backends.base import ObjectInfo
from ..errors import CkptStoreError
from ..protocol import canonical_json
from ..protocol.layout import COMMITS_DIR
from .bounded_io import RunIO

INDEX_DIR = "index"
PACK_KIND = "commit-pack"
#: The largest pack read or written (a bigger one is ignored, never read in part).
MAX_PACK_BYTES = 64 << 20
#: A pack is read when a walk misses this many records, and written again when it lacks this many.
MIN_NEW_RECORDS = 64
_MD5 = re.compile(r"[0-9a-f]{32}")


def pack_key(run_id: str) -> str:
    return f"{run_id}/{INDEX_DIR}/commits.json"


def usable(io: RunIO) -> bool:
    """Whether the run's backend lists a content digest a pack entry can be checked against."""
    return io.backend.capabilities.version_is_md5


def listed_md5(info: ObjectInfo) -> str | None:
    """The MD5 a listing entry states (an ETag of one request; a multipart ETag ``...-N`` is None)."""
    v = info.version.strip().strip('"').lower()
    return v if _MD5.fullmatch(v) else None


def read_pack(io: RunIO, commits: Mapping[str, ObjectInfo]) -> dict[str, bytes]:
    """Record bytes by commit key, for the listed commits (``commits``, by key)
    whose pack entry is provably their bytes; empty when the backend cannot
    prove it or no usable pack exists."""
    if not usable(io) or not commits:
        return {}
    try:
        data = io.get_bounded(pack_key(io.run_id), MAX_PACK_BYTES)
    except CkptStoreError:
        return {}  # missing, unreadable, away: the records are read instead
    if len(data) > MAX_PACK_BYTES:
        return {}
    try:
        value = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}
    if not isinstance(value, dict) or value.get("kind") != PACK_KIND or value.get("run_id") != io.run_id:
        return {}
    records = value.get("records")
    if not isinstance(records, dict):
        return {}
    prefix = f"{io.run_id}/{COMMITS_DIR}/"
    out: dict[str, bytes] = {}
    for key, info in commits.items():
        entry = records.get(key[len(prefix) :]) if key.startswith(prefix) else None
        want = listed_md5(info)
        if want is None or not isinstance(entry, str) or len(entry) != info.size:
            continue
        try:
            raw = entry.encode("ascii")
        except UnicodeEncodeError:
            continue
        if hashlib.md5(raw, usedforsecurity=False).hexdigest() == want:
            out[key] = raw
    return out


def write_pack(io: RunIO, records: Mapping[str, tuple[ObjectInfo, bytes]]) -> bool:
    """Write the pack of ``records`` (by commit key: the listing entry and the
    bytes read under it), keeping only entries a reader can prove; False when
    nothing was written (too big, not usable, or the write failed)."""
    if not usable(io):
        return False
    prefix = f"{io.run_id}/{COMMITS_DIR}/"
    entries: dict[str, str] = {}
    for key, (info, raw) in records.items():
        if key.startswith(prefix) and len(raw) == info.size and raw.isascii() and listed_md5(info) == hashlib.md5(
            raw, usedforsecurity=False
        ).hexdigest():
            entries[key[len(prefix) :]] = raw.decode("ascii")
    data = canonical_json({"kind": PACK_KIND, "run_id": io.run_id, "records": entries})
    if len(data) > MAX_PACK_BYTES:
        return False
    try:
        io.retry.call(lambda: io.backend.put(pack_key(io.run_id), [data]))
    except (CkptStoreError, OSError):
        return False
    return True
