"""Typed records (run, attempt, commit, event): canonical encoding and strict,
bounded decoding. Pure: no I/O.

A stored record is hostile input until proven otherwise. ``decode`` checks, in
order: the size cap, strict canonical JSON (:mod:`.canonical`), the version
(a newer one raises :class:`UnsupportedVersion`), the kind, and every known
field's exact type and range. Unknown top-level fields are tolerated (fields
may be added within a protocol version) but count against the size cap. Every
failure is :class:`CorruptionError` naming the record.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import blake3

from ..errors import CorruptionError
from .auth import AuthTag
from .canonical import canonical_json, decode_json
from .layout import (
    DEFAULT_VERSION,
    MAX_ATTEMPT,
    MAX_STEP,
    PIECES_VERSION,
    PROTOCOL_VERSION,
    is_component_name,
    is_digest,
    parse_save_id,
    validate_event_kind,
)

# PROTOCOL_VERSION (defined with the layouts): a reader accepts records whose
# version is <= it; a record with a higher version is reported as "unsupported
# protocol version" and never selected or deleted. A writer stamps every
# record with the version of the run it writes into (PROTOCOL.md §1.1), so a
# run created under version 1 stays readable by a version-1 reader.

#: Size caps, checked before parsing.
MAX_RUN_RECORD = 1 << 20
MAX_ATTEMPT_RECORD = 64 << 10
MAX_COMMIT_RECORD = 16 << 20
MAX_EVENT_RECORD = 1 << 20
MAX_INTENT_RECORD = 16 << 20
#: Pieces one commit record may name in all (its 16 MiB cap bounds them too).
MAX_PIECES = 200_000
MAX_COMPONENTS = 100_000
MAX_ABANDONS = 1024
MAX_SIZE = 1 << 62

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_WRITER = re.compile(r"^[0-9A-Za-z._:-]{1,128}$")
T = TypeVar("T")


class UnsupportedVersion(CorruptionError):
    """A record written by a newer ckptstore: never selected, never deleted."""

    def __init__(self, version: int, where: str) -> None:
        self.version = version
        super().__init__(
            f"{where}: written with protocol_version {version}; this ckptstore reads up to "
            f"{PROTOCOL_VERSION}. Upgrade ckptstore to read it."
        )


def now() -> float:
    return time.time()


def digest_bytes(data: bytes | memoryview) -> str:
    return blake3.blake3(data).hexdigest()


def _auth_of(rec: Mapping[str, Any], where: str, data: bytes) -> tuple[AuthTag | None, str]:
    """(the record's tag, the digest of its canonical bytes without the tag).
    ``data`` is the record's canonical encoding (checked by the decoder): an
    untagged record's body digest is the digest of its bytes, no re-encoding."""
    if "auth" not in rec:
        return None, digest_bytes(data)
    tag = AuthTag.parse(rec["auth"])
    if tag is None:
        raise CorruptionError(f"{where}: malformed auth field")
    body = {k: v for k, v in rec.items() if k != "auth"}
    return tag, digest_bytes(canonical_json(body))


def _with_auth(rec: dict[str, Any], auth: AuthTag | None) -> dict[str, Any]:
    if auth is not None:
        rec["auth"] = auth.to_json()
    return rec


class Signable:
    """The authentication fields every record carries (PROTOCOL.md §2.5)."""

    kind = ""
    auth: AuthTag | None
    body_digest: str
    version: int

    def to_record(self) -> dict[str, Any]:
        raise NotImplementedError

    def unsigned_digest(self) -> str:
        """BLAKE3 of the record's canonical bytes without its tag: what a tag covers."""
        rec = self.to_record()
        rec.pop("auth", None)
        return digest_bytes(canonical_json(rec))

    def encode(self) -> bytes:
        return canonical_json(self.to_record())


def _decode(data: bytes, *, kind: str, where: str, max_bytes: int) -> dict[str, Any]:
    rec = decode_json(data, where=where, max_bytes=max_bytes, canonical=True)
    if not isinstance(rec, dict):
        raise CorruptionError(f"{where}: record is not a JSON object")
    version = rec.get("protocol_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptionError(f"{where}: record has no valid protocol_version")
    if version > PROTOCOL_VERSION:
        raise UnsupportedVersion(version, where)
    if rec.get("kind") != kind:
        raise CorruptionError(f"{where}: expected a {kind!r} record, found kind={str(rec.get('kind'))[:40]!r}")
    return rec


class _Fields:
    """Typed access to a decoded record's fields; every failure names the field."""

    def __init__(self, rec: Mapping[str, Any], where: str, kind: str) -> None:
        self.rec, self.where, self.kind = rec, where, kind

    def bad(self, name: str, want: str) -> CorruptionError:
        return CorruptionError(f"{self.where}: {self.kind} record field {name!r} is missing or not {want}")

    def get(self, name: str, typ: type[T], want: str) -> T:
        v = self.rec.get(name)
        if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
            raise self.bad(name, want)
        return v

    def int_in(self, name: str, lo: int, hi: int, *, optional: bool = False) -> int | None:
        v = self.rec.get(name)
        if v is None and optional and name in self.rec:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.bad(name, f"an integer in {lo}..{hi}" + (" or null" if optional else ""))
        return v

    def time(self, name: str) -> float:
        v = self.rec.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e11:
            raise self.bad(name, "a time in seconds since the epoch")
        return float(v)

    def text(self, name: str, pattern: re.Pattern[str] | None = None, max_len: int = 256) -> str:
        v = self.get(name, str, "a string")
        if len(v) > max_len or (pattern is not None and not pattern.match(v)):
            raise self.bad(name, "a well-formed string")
        return v

    def obj(self, name: str, *, optional: bool = False) -> dict[str, Any] | None:
        v = self.rec.get(name)
        if v is None and optional:
            return None
        if not isinstance(v, dict):
            raise self.bad(name, "a JSON object")
        return v


def _check_run_id(f: _Fields, run_id: str | None) -> str:
    rid = f.text("run_id", max_len=128)
    if run_id is not None and rid != run_id:
        raise CorruptionError(f"{f.where}: {f.kind} record names run {rid[:128]!r}, not {run_id!r}")
    return rid


# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord(Signable):
    """``RUN.json``: the identity a run is bound to, created exclusively once."""

    run_id: str
    identity: dict[str, Any]
    identity_digest: str
    created_at: float
    lineage: dict[str, Any] | None = None
    auth: AuthTag | None = field(default=None, compare=False)
    body_digest: str = field(default="", compare=False)
    #: protocol version stamped into the record: the version of the run it belongs to
    version: int = field(default=DEFAULT_VERSION, compare=False)
    kind = "run"

    def to_record(self) -> dict[str, Any]:
        return _with_auth(
            {
                "protocol_version": self.version,
                "kind": "run",
                "run_id": self.run_id,
                "identity": self.identity,
                "identity_digest": self.identity_digest,
                "created_at": self.created_at,
                "lineage": self.lineage,
            },
            self.auth,
        )

    @classmethod
    def decode(cls, data: bytes, where: str, *, run_id: str | None = None) -> RunRecord:
        raw = _decode(data, kind="run", where=where, max_bytes=MAX_RUN_RECORD)
        f = _Fields(raw, where, "run")
        identity = f.obj("identity")
        assert identity is not None
        return cls(
            _check_run_id(f, run_id), identity, f.text("identity_digest", _HEX64), f.time("created_at"),
            f.obj("lineage", optional=True), *_auth_of(raw, where, data), version=raw["protocol_version"],
        )


@dataclass(frozen=True)
class AttemptRecord(Signable):
    """One start of a job that opened the run for writing.

    ``number`` is a fencing token: it was created with create-if-absent, so no
    two jobs hold the same one. ``resumed_from`` is the step the attempt
    resumed from (None: from scratch). ``abandons`` lists earlier numbers the
    same writer registered and gave up before writing anything (§4.2).
    """

    run_id: str
    number: int
    resumed_from: int | None
    writer_id: str
    created_at: float
    abandons: tuple[int, ...] = ()
    host: str = ""
    auth: AuthTag | None = field(default=None, compare=False)
    body_digest: str = field(default="", compare=False)
    #: protocol version stamped into the record: the version of the run it belongs to
    version: int = field(default=DEFAULT_VERSION, compare=False)
    kind = "attempt"

    def to_record(self) -> dict[str, Any]:
        return _with_auth({
            "protocol_version": self.version,
            "kind": "attempt",
            "run_id": self.run_id,
            "attempt": self.number,
            "resumed_from": self.resumed_from,
            "writer_id": self.writer_id,
            "created_at": self.created_at,
            "abandons": list(self.abandons),
            "host": self.host,
        }, self.auth)

    @classmethod
    def decode(cls, data: bytes, where: str, *, run_id: str | None = None, number: int | None = None) -> AttemptRecord:
        raw = _decode(data, kind="attempt", where=where, max_bytes=MAX_ATTEMPT_RECORD)
        f = _Fields(raw, where, "attempt")
        n = f.int_in("attempt", 1, MAX_ATTEMPT)
        assert n is not None
        if number is not None and n != number:
            raise CorruptionError(f"{where}: attempt record names attempt {n}, its key says {number}")
        abandons = f.rec.get("abandons", [])
        if not isinstance(abandons, list) or len(abandons) > MAX_ABANDONS or not all(
            isinstance(a, int) and not isinstance(a, bool) and 1 <= a < n for a in abandons
        ):
            raise f.bad("abandons", f"a list of earlier attempt numbers (at most {MAX_ABANDONS})")
        return cls(
            _check_run_id(f, run_id), n, f.int_in("resumed_from", 0, MAX_STEP, optional=True),
            f.text("writer_id", _WRITER), f.time("created_at"), tuple(abandons), f.text("host"), *_auth_of(raw, where, data),
            version=raw["protocol_version"],
        )


@dataclass(frozen=True)
class PieceRef:
    """One piece of a component (PROTOCOL.md §9.1): ``size`` bytes whose BLAKE3
    is ``digest``, stored under the save that first wrote them (``holder``)."""

    holder: str
    digest: str
    size: int

    def to_json(self) -> list[Any]:
        return [self.holder, self.digest, self.size]

    def as_entry(self) -> ComponentEntry:
        """The piece as one object to read and verify: ``size`` bytes whose BLAKE3 is ``digest``
        (named by its digest in messages)."""
        return ComponentEntry(self.digest, self.size, self.digest)


def pieces_digest(pieces: Sequence[PieceRef]) -> str:
    """The ``blake3`` of a pieced component: BLAKE3 of the canonical JSON list of
    its pieces' ``[digest, size]``, in order. The content, not where it lives:
    two saves of the same bytes get the same value whichever save holds them."""
    return digest_bytes(canonical_json([[p.digest, p.size] for p in pieces]))


@dataclass(frozen=True)
class ComponentEntry:
    """One component of a save, as promised by its commit record. ``pieces``
    (version 3): the pieces whose concatenation is the component; ``blake3``
    is then :func:`pieces_digest` of them, not of the bytes."""

    name: str
    size: int
    blake3: str
    pieces: tuple[PieceRef, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "blake3": self.blake3}
        if self.pieces is not None:
            out["pieces"] = [p.to_json() for p in self.pieces]
        return out

    def matches(self, blocks: Iterable[Any]) -> bool:
        """Whether ``blocks`` (buffers, in order) are exactly the bytes this
        entry promises: its size and BLAKE3 — or, stored as pieces, each
        piece's size and digest in turn, so the same bytes match whatever
        cuts their writer chose. Stops reading at the first difference."""
        if self.pieces is None:
            h, n = blake3.blake3(), 0
            for b in blocks:
                n += memoryview(b).nbytes
                if n > self.size:
                    return False
                h.update(b)
            return n == self.size and h.hexdigest() == self.blake3
        it = iter(self.pieces)
        cur = next(it, None)
        h, left = blake3.blake3(), (cur.size if cur is not None else 0)
        for b in blocks:
            view = memoryview(b).cast("B")
            while len(view):
                if cur is None:
                    return False  # more bytes than the pieces hold
                take = min(left, len(view))
                h.update(view[:take])
                view, left = view[take:], left - take
                if left == 0:
                    if h.hexdigest() != cur.digest:
                        return False
                    cur = next(it, None)
                    h, left = blake3.blake3(), (cur.size if cur is not None else 0)
        return cur is None


def _decode_pieces(raw: object, where: str, name: str, size: int, digest: str) -> tuple[PieceRef, ...]:
    """A component's ``pieces`` list, checked: each ``[holder save ID, digest, size]``,
    the sizes adding up to the component's, the component's digest theirs."""
    bad = CorruptionError(f"{where}: component {name[:80]!r} has a malformed piece list")
    if not isinstance(raw, list) or len(raw) > MAX_PIECES:
        raise bad
    out: list[PieceRef] = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3:
            raise bad
        holder, d, n = item
        if not isinstance(holder, str) or parse_save_id(holder) is None or not is_digest(d):
            raise bad
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_SIZE:
            raise bad
        out.append(PieceRef(holder, d, n))
    if sum(p.size for p in out) != size:
        raise CorruptionError(f"{where}: component {name[:80]!r}: its pieces add up to another size than {size}")
    if pieces_digest(out) != digest:
        raise CorruptionError(f"{where}: component {name[:80]!r}: its blake3 is not the digest of its piece list")
    return tuple(out)


@dataclass(frozen=True)
class CommitRecord(Signable):
    """The commit record: the manifest of one save, created exclusively.

    Its existence is what publishes the save. ``writer_id`` is unique per
    writer so a lost acknowledgement can be resolved by reading it back.
    ``ranks`` (multi-process saves) maps each rank to the components it wrote;
    ``world_size`` is the number of ranks that took part.
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
    ranks: dict[int, tuple[str, ...]] | None = None
    world_size: int | None = None
    auth: AuthTag | None = field(default=None, compare=False)
    body_digest: str = field(default="", compare=False)
    #: BLAKE3 of the stored bytes, set when decoded (they are canonical, so it is the manifest digest)
    stored_digest: str = field(default="", compare=False)
    #: protocol version stamped into the record: the version of the run it belongs to
    version: int = field(default=DEFAULT_VERSION, compare=False)
    kind = "commit"

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "protocol_version": self.version,
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
        if self.ranks is not None:
            rec["ranks"] = {str(r): sorted(names) for r, names in sorted(self.ranks.items())}
        if self.world_size is not None:
            rec["world_size"] = self.world_size
        return _with_auth(rec, self.auth)

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.components.values())

    def piece_refs(self) -> dict[tuple[str, str], int]:
        """Every piece the save needs, once: (holder, digest) -> size."""
        out: dict[tuple[str, str], int] = {}
        for c in self.components.values():
            for p in c.pieces or ():
                out[(p.holder, p.digest)] = p.size
        return out

    def bytes_written(self) -> int:
        """Bytes this save wrote itself: whole components, and pieces it holds."""
        own = sum(c.size for c in self.components.values() if c.pieces is None)
        return own + sum(n for (holder, _), n in self.piece_refs().items() if holder == self.save_id)

    def manifest_digest(self) -> str:
        return self.stored_digest or digest_bytes(self.encode())

    @classmethod
    def decode(
        cls, data: bytes, where: str, *, run_id: str | None = None, step: int | None = None, attempt: int | None = None
    ) -> CommitRecord:
        raw = _decode(data, kind="commit", where=where, max_bytes=MAX_COMMIT_RECORD)
        f = _Fields(raw, where, "commit")
        s = f.int_in("step", 0, MAX_STEP)
        a = f.int_in("attempt", 1, MAX_ATTEMPT)
        assert s is not None and a is not None
        if (step is not None and s != step) or (attempt is not None and a != attempt):
            raise CorruptionError(f"{where}: record names step {s}, attempt {a}, not those of its key")
        sid = f.text("save_id", max_len=64)
        if parse_save_id(sid) != (s, a):
            raise CorruptionError(f"{where}: save_id {sid!r} does not name step {s}, attempt {a}")
        listed = f.obj("components")
        assert listed is not None
        if len(listed) > MAX_COMPONENTS:
            raise f.bad("components", f"at most {MAX_COMPONENTS} entries")
        comps: dict[str, ComponentEntry] = {}
        for n, c in listed.items():
            if not is_component_name(n):
                raise CorruptionError(f"{where}: commit record names an unsafe component {n[:80]!r}")
            size, digest = (c.get("size"), c.get("blake3")) if isinstance(c, dict) else (None, None)
            if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE:
                raise f.bad(f"components.{n}.size", "a byte count")
            if not isinstance(digest, str) or not _HEX64.match(digest):
                raise f.bad(f"components.{n}.blake3", "a BLAKE3 hex digest")
            pieces = None
            if isinstance(c, dict) and "pieces" in c:
                if raw["protocol_version"] < PIECES_VERSION:
                    raise CorruptionError(f"{where}: component {n[:80]!r} lists pieces in a version-"
                                          f"{raw['protocol_version']} record")
                pieces = _decode_pieces(c["pieces"], where, n, size, digest)
            comps[n] = ComponentEntry(n, size, digest, pieces)
        metadata = f.obj("metadata")
        assert metadata is not None
        ranks: dict[int, tuple[str, ...]] | None = None
        if "ranks" in f.rec:
            rr = f.obj("ranks")
            assert rr is not None
            ranks = {}
            for r, names in rr.items():
                # one spelling per rank: ASCII digits, no leading zero ('²', '١', '01' are not ranks)
                canonical = r.isascii() and r.isdigit() and len(r) <= 7 and str(int(r)) == r
                if not canonical or not isinstance(names, list) or not all(n in comps for n in names):
                    raise f.bad("ranks", "a map of rank numbers to names of listed components")
                ranks[int(r)] = tuple(names)
        world = f.int_in("world_size", 1, 1 << 20) if "world_size" in f.rec else None
        tag, body = _auth_of(raw, where, data)
        return cls(
            _check_run_id(f, run_id), s, a, sid, f.text("writer_id", _WRITER), f.text("identity_digest", _HEX64),
            comps, f.time("created_at"), metadata, ranks, world, tag, body, body if tag is None else digest_bytes(data),
            version=raw["protocol_version"],
        )


@dataclass(frozen=True)
class EventRecord(Signable):
    """One entry of the run's append-only ledger."""

    event: str
    at: float
    attempt: int | None
    payload: dict[str, Any]
    auth: AuthTag | None = field(default=None, compare=False)
    body_digest: str = field(default="", compare=False)
    #: protocol version stamped into the record: the version of the run it belongs to
    version: int = field(default=DEFAULT_VERSION, compare=False)
    kind = "event"

    def to_record(self) -> dict[str, Any]:
        return _with_auth(
            {
                "protocol_version": self.version,
                "kind": "event",
                "event": self.event,
                "at": self.at,
                "attempt": self.attempt,
                "payload": self.payload,
            },
            self.auth,
        )

    def to_json(self) -> dict[str, Any]:
        return {"kind": "event", "event": self.event, "at": self.at, "attempt": self.attempt, "payload": self.payload}

    @classmethod
    def decode(cls, data: bytes, where: str) -> EventRecord:
        raw = _decode(data, kind="event", where=where, max_bytes=MAX_EVENT_RECORD)
        f = _Fields(raw, where, "event")
        kind = f.text("event", max_len=64)
        try:
            validate_event_kind(kind)
        except ValueError:
            raise f.bad("event", "an event kind") from None
        payload = f.obj("payload")
        assert payload is not None
        return cls(
            kind, f.time("at"), f.int_in("attempt", 1, MAX_ATTEMPT, optional=True), payload, *_auth_of(raw, where, data),
            version=raw["protocol_version"],
        )


@dataclass(frozen=True)
class IntentRecord(Signable):
    """A save intent (PROTOCOL.md §9.3): the pieces a writer of ``attempt`` may
    rely on in a save that is not committed yet, written before it relies on
    them, live until ``expires_at``. gc keeps every piece a live intent names."""

    run_id: str
    attempt: int
    created_at: float
    expires_at: float
    pieces: tuple[tuple[str, str], ...]
    auth: AuthTag | None = field(default=None, compare=False)
    body_digest: str = field(default="", compare=False)
    version: int = field(default=PIECES_VERSION, compare=False)
    kind = "intent"

    def to_record(self) -> dict[str, Any]:
        return _with_auth({
            "protocol_version": self.version,
            "kind": "intent",
            "run_id": self.run_id,
            "attempt": self.attempt,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "pieces": [list(p) for p in sorted(self.pieces)],
        }, self.auth)

    @classmethod
    def decode(cls, data: bytes, where: str, *, run_id: str | None = None, attempt: int | None = None) -> IntentRecord:
        raw = _decode(data, kind="intent", where=where, max_bytes=MAX_INTENT_RECORD)
        f = _Fields(raw, where, "intent")
        n = f.int_in("attempt", 1, MAX_ATTEMPT)
        assert n is not None
        if attempt is not None and n != attempt:
            raise CorruptionError(f"{where}: intent record names attempt {n}, its key says {attempt}")
        listed = f.rec.get("pieces")
        if not isinstance(listed, list) or len(listed) > MAX_PIECES or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and parse_save_id(p[0]) is not None
            and is_digest(p[1]) for p in listed
        ):
            raise f.bad("pieces", "a list of [holder save ID, digest] pairs")
        created, expires = f.time("created_at"), f.time("expires_at")
        if expires < created:
            raise f.bad("expires_at", "a time after created_at")
        return cls(
            _check_run_id(f, run_id), n, created, expires, tuple((p[0], p[1]) for p in listed),
            *_auth_of(raw, where, data), version=raw["protocol_version"],
        )
