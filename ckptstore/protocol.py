"""Pure protocol logic: object layout, names, record encoding and validation.

Nothing here performs I/O. ``protocol_spec/PROTOCOL.md`` is the normative
description; this module is its executable form and the two must agree.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import blake3

from .errors import CorruptionError, InvalidInputError

#: Version written into every record. A reader accepts records whose version
#: is <= this number; a record with a higher version is reported as
#: "unsupported protocol version" and never selected or deleted.
PROTOCOL_VERSION = 1

RUN_RECORD = "RUN.json"
ATTEMPTS_DIR = "attempts"
SAVES_DIR = "saves"
COMMITS_DIR = "commits"
EVENTS_DIR = "events"

STEP_WIDTH = 12
ATTEMPT_WIDTH = 8
MAX_STEP = 10**STEP_WIDTH - 1
MAX_ATTEMPT = 10**ATTEMPT_WIDTH - 1

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
_COMMIT_RE = re.compile(rf"^(\d{{{STEP_WIDTH}}})\.(\d{{{ATTEMPT_WIDTH}}})\.json$")
_ATTEMPT_RE = re.compile(rf"^(\d{{{ATTEMPT_WIDTH}}})\.json$")
_SAVE_ID_RE = re.compile(rf"^(\d{{{STEP_WIDTH}}})-(\d{{{ATTEMPT_WIDTH}}})-([0-9a-f]{{12}})$")

#: Suffix the local backend uses for its temporary files; never a valid name.
TMP_MARK = ".ckpt-tmp-"


# ---------------------------------------------------------------------------
# validation


def validate_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not run_id:
        raise InvalidInputError("run ID must be a non-empty string")
    if not _RUN_ID_RE.match(run_id):
        raise InvalidInputError(
            f"run ID {run_id!r} is invalid: use 1-128 characters from letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return run_id


def validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidInputError(f"step must be an int, got {type(step).__name__}")
    if step < 0 or step > MAX_STEP:
        raise InvalidInputError(f"step must be between 0 and {MAX_STEP}, got {step}")
    return step


def validate_component_name(name: object) -> str:
    """A component name is a relative path of '/'-separated safe segments.

    It can never escape the save's prefix: no absolute paths, no '..' or '.',
    no backslashes, no empty segments, nothing that looks like a temp file.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInputError("component name must be a non-empty string")
    if len(name) > 512:
        raise InvalidInputError(f"component name is too long ({len(name)} > 512 characters)")
    if name.startswith("/") or "\\" in name or "\x00" in name:
        raise InvalidInputError(f"component name {name!r} must be a relative path inside the save")
    for seg in name.split("/"):
        if seg in ("", ".", ".."):
            raise InvalidInputError(f"component name {name!r} has an empty, '.' or '..' segment")
        if not _SEGMENT_RE.match(seg) or TMP_MARK in seg:
            raise InvalidInputError(
                f"component name {name!r}: segment {seg!r} may use only letters, digits, '.', '_' and '-' "
                "and must not start with '.' or '-'"
            )
    return name


# ---------------------------------------------------------------------------
# layout


def run_prefix(run_id: str) -> str:
    return f"{run_id}/"


def run_record_key(run_id: str) -> str:
    return f"{run_id}/{RUN_RECORD}"


def attempt_key(run_id: str, attempt: int) -> str:
    return f"{run_id}/{ATTEMPTS_DIR}/{attempt:0{ATTEMPT_WIDTH}d}.json"


def attempts_prefix(run_id: str) -> str:
    return f"{run_id}/{ATTEMPTS_DIR}/"


def commits_prefix(run_id: str) -> str:
    return f"{run_id}/{COMMITS_DIR}/"


def commit_key(run_id: str, step: int, attempt: int) -> str:
    return f"{run_id}/{COMMITS_DIR}/{step:0{STEP_WIDTH}d}.{attempt:0{ATTEMPT_WIDTH}d}.json"


def saves_prefix(run_id: str) -> str:
    return f"{run_id}/{SAVES_DIR}/"


def save_prefix(run_id: str, save_id: str) -> str:
    return f"{run_id}/{SAVES_DIR}/{save_id}/"


def component_key(run_id: str, save_id: str, name: str) -> str:
    return f"{run_id}/{SAVES_DIR}/{save_id}/{name}"


def events_prefix(run_id: str) -> str:
    return f"{run_id}/{EVENTS_DIR}/"


def new_save_id(step: int, attempt: int) -> str:
    """Unique per save: step and attempt for humans, 48 random bits for uniqueness."""
    return f"{step:0{STEP_WIDTH}d}-{attempt:0{ATTEMPT_WIDTH}d}-{uuid.uuid4().hex[:12]}"


def parse_commit_name(name: str) -> tuple[int, int] | None:
    m = _COMMIT_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_attempt_name(name: str) -> int | None:
    m = _ATTEMPT_RE.match(name)
    return int(m.group(1)) if m else None


def parse_save_id(save_id: str) -> tuple[int, int] | None:
    m = _SAVE_ID_RE.match(save_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---------------------------------------------------------------------------
# records


def encode_record(record: dict[str, Any]) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8. Byte-stable, so two
    encodings of one record compare equal (used by the lost-ack read-back)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_record(data: bytes, *, kind: str, where: str) -> dict[str, Any]:
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptionError(f"{where}: record is not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise CorruptionError(f"{where}: record is not a JSON object")
    version = record.get("protocol_version")
    if not isinstance(version, int):
        raise CorruptionError(f"{where}: record has no protocol_version")
    if version > PROTOCOL_VERSION:
        raise UnsupportedVersion(version, where)
    if record.get("kind") != kind:
        raise CorruptionError(f"{where}: expected a {kind!r} record, found kind={record.get('kind')!r}")
    return record


class UnsupportedVersion(CorruptionError):
    """A record written by a newer ckptstore: never selected, never deleted."""

    def __init__(self, version: int, where: str) -> None:
        self.version = version
        super().__init__(
            f"{where}: written with protocol_version {version}; this ckptstore reads up to "
            f"{PROTOCOL_VERSION}. Upgrade ckptstore to read it."
        )


def digest_bytes(data: bytes | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


def now() -> float:
    return time.time()


@dataclass(frozen=True)
class ComponentEntry:
    """One component of a save, as promised by its commit record."""

    name: str
    size: int
    blake3: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "blake3": self.blake3}


@dataclass(frozen=True)
class CommitRecord:
    """The commit record: the manifest of one save, created exclusively.

    Its existence is what publishes the save. ``writer_id`` is unique per
    writer so a lost acknowledgement can be resolved by reading it back.
    """

    run_id: str
    step: int
    attempt: int
    save_id: str
    writer_id: str
    identity_digest: str
    components: dict[str, ComponentEntry]
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "protocol_version": PROTOCOL_VERSION,
            "kind": "commit",
            "run_id": self.run_id,
            "step": self.step,
            "attempt": self.attempt,
            "save_id": self.save_id,
            "writer_id": self.writer_id,
            "identity_digest": self.identity_digest,
            "created_at": self.created_at,
            "components": {n: c.to_json() for n, c in sorted(self.components.items())},
            "metadata": self.metadata,
        }

    def encode(self) -> bytes:
        return encode_record(self.to_record())

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.components.values())

    @classmethod
    def decode(cls, data: bytes, where: str) -> CommitRecord:
        rec = decode_record(data, kind="commit", where=where)
        try:
            comps = {
                str(n): ComponentEntry(str(n), int(c["size"]), str(c["blake3"]))
                for n, c in dict(rec["components"]).items()
            }
            out = cls(
                run_id=str(rec["run_id"]),
                step=int(rec["step"]),
                attempt=int(rec["attempt"]),
                save_id=str(rec["save_id"]),
                writer_id=str(rec["writer_id"]),
                identity_digest=str(rec["identity_digest"]),
                components=comps,
                created_at=float(rec["created_at"]),
                metadata=dict(rec.get("metadata") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"{where}: commit record is missing or has a malformed field ({exc})") from None
        for n in comps:
            try:
                validate_component_name(n)
            except InvalidInputError:
                raise CorruptionError(f"{where}: commit record names an unsafe component {n!r}") from None
        return out

    def manifest_digest(self) -> str:
        return digest_bytes(self.encode())


@dataclass(frozen=True)
class AttemptRecord:
    """One process start of a run that opened it for writing.

    ``number`` is a fencing token: it was created with create-if-absent, so no
    two processes hold the same one. ``resumed_from`` is the step the attempt
    resumed from (None: it started from scratch). ``abandons`` lists earlier
    attempt numbers registered by the same process that never wrote anything.
    """

    run_id: str
    number: int
    resumed_from: int | None
    writer_id: str
    created_at: float
    abandons: tuple[int, ...] = ()
    host: str = ""

    def to_record(self) -> dict[str, Any]:
        return {
            "protocol_version": PROTOCOL_VERSION,
            "kind": "attempt",
            "run_id": self.run_id,
            "attempt": self.number,
            "resumed_from": self.resumed_from,
            "writer_id": self.writer_id,
            "created_at": self.created_at,
            "abandons": list(self.abandons),
            "host": self.host,
        }

    def encode(self) -> bytes:
        return encode_record(self.to_record())

    @classmethod
    def decode(cls, data: bytes, where: str) -> AttemptRecord:
        rec = decode_record(data, kind="attempt", where=where)
        try:
            rf = rec["resumed_from"]
            return cls(
                run_id=str(rec["run_id"]),
                number=int(rec["attempt"]),
                resumed_from=None if rf is None else int(rf),
                writer_id=str(rec["writer_id"]),
                created_at=float(rec["created_at"]),
                abandons=tuple(int(x) for x in rec.get("abandons", [])),
                host=str(rec.get("host", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(f"{where}: attempt record malformed ({exc})") from None
