"""CheckpointStore: crash-consistent saves on any backend.

The sequences implemented here are specified in ``protocol_spec/PROTOCOL.md``;
keep the two in step.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, overload

import blake3

from . import protocol as P
from .backends.base import Backend, ObjectInfo
from .errors import (
    CommitConflictError,
    CommitUnknownError,
    CorruptionError,
    IdentityMismatchError,
    InvalidInputError,
    NotFoundError,
    SaveAbortedError,
    StoreUnavailableError,
    SupersededError,
    TransientError,
    UnsupportedBackendError,
)
from .identity import RunIdentity, diff_identity, identity_digest, normalize_identity
from .retry import RetryPolicy
from .selection import (
    SaveState,
    Skip,
    SkipReason,
    candidate_order,
    describe_superseder,
    effective_attempts,
    superseded_by,
    uncommitted_state,
)
from .streams import CHUNK, HashingStream, check_data, is_replayable, rewind

DEFAULT_GRACE_SECONDS = 3600.0
ResumeFrom = int | None | Literal["latest"]


@dataclass(frozen=True)
class SaveRef:
    """A committed save: what ``latest_complete()`` returns and ``read()`` takes."""

    run_id: str
    step: int
    attempt: int
    save_id: str
    record: P.CommitRecord
    manifest_digest: str

    @property
    def components(self) -> dict[str, P.ComponentEntry]:
        return self.record.components

    @property
    def metadata(self) -> dict[str, Any]:
        return self.record.metadata

    @property
    def total_bytes(self) -> int:
        return self.record.total_bytes


@dataclass(frozen=True)
class Selection:
    """The answer of ``latest_complete(explain=True)``."""

    latest: SaveRef | None
    skipped: list[Skip]


@dataclass(frozen=True)
class SaveInfo:
    """One save as listed by ``list_saves()``."""

    save_id: str
    step: int
    attempt: int
    state: SaveState
    detail: str
    bytes: int
    components: int
    created_at: float | None
    selected: bool = False
    ref: SaveRef | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "save_id": self.save_id,
            "step": self.step,
            "attempt": self.attempt,
            "state": self.state.value,
            "detail": self.detail,
            "bytes": self.bytes,
            "components": self.components,
            "created_at": self.created_at,
            "selected": self.selected,
            "manifest_digest": self.ref.manifest_digest if self.ref else None,
        }


@dataclass
class VerifyReport:
    ref: SaveRef
    deep: bool
    problems: list[tuple[SkipReason, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class GcAction:
    key: str
    reason: str


@dataclass
class GcReport:
    dry_run: bool
    kept: list[str]
    deleted_saves: list[tuple[str, str]]
    actions: list[GcAction]
    #: temporary files of killed writers (local disk), older than the grace period
    temporaries: list[str] = field(default_factory=list)



class _Scan:
    """One consistent-enough snapshot of a run's listings (3 LIST calls)."""

    def __init__(self, store: CheckpointStore) -> None:
        rid = store.run_id
        b = store.backend
        r = store._retry.call
        self.commits: dict[tuple[int, int], ObjectInfo] = {}
        for o in r(lambda: b.list(P.commits_prefix(rid))):
            sa = P.parse_commit_name(o.key.rsplit("/", 1)[-1])
            if sa is not None:
                self.commits[sa] = o
        self.save_objects: dict[str, dict[str, ObjectInfo]] = {}
        sp = P.saves_prefix(rid)
        for o in r(lambda: b.list(sp)):
            rest = o.key[len(sp) :]
            if "/" not in rest:
                continue
            sid, name = rest.split("/", 1)
            self.save_objects.setdefault(sid, {})[name] = o
        self.attempts = store._load_attempts()
        self.effective = effective_attempts(self.attempts)


class CheckpointStore:
    """Crash-consistent checkpoints of one run on one backend.

    Open with :meth:`open`. A store opened for writing (``mode="w"``, the
    default when an ``identity`` is given) binds or checks the run identity and
    registers a new *attempt* whose number fences older writers; a store opened
    for reading registers nothing and writes nothing.

    Thread safety: one store may be shared by threads; each ``save()`` is
    independent. Across processes, every guarantee rests on the backend's
    atomic create-if-absent.
    """

    def __init__(
        self,
        backend: Backend,
        run_id: str,
        *,
        identity: RunIdentity | Mapping[str, Any] | None = None,
        mode: Literal["r", "w"] | None = None,
        resume_from: ResumeFrom = "latest",
        retry: RetryPolicy | None = None,
        lineage: Mapping[str, Any] | None = None,
        resume_verify: Literal["deep", "cheap"] = "deep",
    ) -> None:
        self.backend = backend
        if resume_verify not in ("deep", "cheap"):
            raise InvalidInputError("resume_verify must be 'deep' or 'cheap'")
        self._resume_deep = resume_verify == "deep"
        self.run_id = P.validate_run_id(run_id)
        self.mode: Literal["r", "w"] = mode or ("w" if identity is not None else "r")
        if self.mode not in ("r", "w"):
            raise InvalidInputError(f"mode must be 'r' or 'w', got {mode!r}")
        if resume_from not in ("latest", None) and not isinstance(resume_from, int):
            raise InvalidInputError(f"resume_from must be 'latest', None or a step, got {resume_from!r}")
        if isinstance(resume_from, int):
            P.validate_step(resume_from)
        self._retry = retry or RetryPolicy()
        self._attempt_cache: dict[int, P.AttemptRecord] = {}
        self.writer_id = uuid.uuid4().hex
        self.attempt: P.AttemptRecord | None = None
        #: The save this attempt resumed from (``mode="w"`` with resume_from="latest").
        self.resumed_from: SaveRef | None = None
        requested = normalize_identity(identity) if identity is not None else None
        if self.mode == "w":
            if requested is None:
                raise InvalidInputError("opening a run for writing needs its identity (identity=...)")
            if not backend.capabilities.atomic_create:
                raise UnsupportedBackendError(
                    f"{backend.url}: this backend cannot create objects atomically (create-if-absent); "
                    "ckptstore refuses to commit on it rather than risk two writers both publishing"
                )
            self.identity = self._bind_identity(requested, lineage)
        else:
            self.identity = self._read_identity(requested)
        self.identity_digest = identity_digest(self.identity)
        if self.mode == "w":
            self._register_attempt(resume_from)

    # ------------------------------------------------------------------ open
    @classmethod
    def open(
        cls,
        url: str | os.PathLike[str] | Backend,
        run_id: str,
        *,
        identity: RunIdentity | Mapping[str, Any] | None = None,
        mode: Literal["r", "w"] | None = None,
        resume_from: ResumeFrom = "latest",
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        lineage: Mapping[str, Any] | None = None,
        resume_verify: Literal["deep", "cheap"] = "deep",
    ) -> CheckpointStore:
        """Open run ``run_id`` in the store at ``url``.

        ``url``: a directory path, ``file://``, ``memory://NAME``, ``s3://bucket/prefix``,
        ``gs://bucket/prefix`` (or ``gcs://``), or a :class:`Backend`.

        Writing (``mode="w"``, default when ``identity`` is given): a new run's
        identity record is created exclusively; an existing run's identity must
        match field for field or :class:`IdentityMismatchError` lists every
        difference. Then an attempt is registered that resumes from
        ``resume_from``: ``"latest"`` (the newest complete save, available as
        :attr:`resumed_from`), a step, or ``None`` for a fresh start.

        The resume point is chosen with a deep check by default (every byte of
        the candidate re-hashed), so a bit flip at rest never becomes the
        attempt's resume point; ``resume_verify="cheap"`` checks sizes only and
        leaves digest verification to the restore (which always verifies).

        Reading (``mode="r"``): the run must exist; nothing is written.
        """
        from .urls import backend_from_url

        backend = url if isinstance(url, Backend) else backend_from_url(url, storage_options=storage_options)
        return cls(
            backend, run_id, identity=identity, mode=mode, resume_from=resume_from, retry=retry, lineage=lineage,
            resume_verify=resume_verify,
        )

    def _where(self, key: str) -> str:
        return f"{self.backend.url.rstrip('/')}/{key}"

    def _get(self, key: str) -> bytes:
        return self._retry.call(lambda: self.backend.get(key))

    def _bind_identity(self, requested: dict[str, Any], lineage: Mapping[str, Any] | None) -> dict[str, Any]:
        key = P.run_record_key(self.run_id)
        record = {
            "protocol_version": P.PROTOCOL_VERSION,
            "kind": "run",
            "run_id": self.run_id,
            "identity": requested,
            "identity_digest": identity_digest(requested),
            "created_at": P.now(),
            "lineage": dict(lineage) if lineage else None,
        }
        created = self._create(key, P.encode_record(record), what="run identity record")
        if created:
            return requested
        stored = self._read_run_record()["identity"]
        self._check_identity(stored, requested)
        return dict(stored)

    def _read_run_record(self) -> dict[str, Any]:
        key = P.run_record_key(self.run_id)
        try:
            data = self._get(key)
        except NotFoundError:
            raise NotFoundError(
                f"run {self.run_id!r} does not exist at {self.backend.url} (no {P.RUN_RECORD}); "
                "open it with an identity to create it"
            ) from None
        rec = P.decode_record(data, kind="run", where=self._where(key))
        if not isinstance(rec.get("identity"), dict):
            raise CorruptionError(f"{self._where(key)}: run record has no identity")
        return rec

    def _read_identity(self, requested: dict[str, Any] | None) -> dict[str, Any]:
        stored = dict(self._read_run_record()["identity"])
        if requested is not None:
            self._check_identity(stored, requested)
        return stored

    def _check_identity(self, stored: Mapping[str, Any], requested: Mapping[str, Any]) -> None:
        diff = diff_identity(stored, requested)
        if diff:
            raise IdentityMismatchError(self.run_id, list(diff), diff)

    @property
    def run_record(self) -> dict[str, Any]:
        return self._read_run_record()

    # ------------------------------------------------------------- attempts
    def _load_attempts(self) -> dict[int, P.AttemptRecord]:
        """Every attempt record: one LIST, and a GET only for numbers not seen
        before. Attempt records are created once and never change, so decoded
        ones are cached; the fences on every save stay one listing."""
        out: dict[int, P.AttemptRecord] = {}
        for o in self._retry.call(lambda: self.backend.list(P.attempts_prefix(self.run_id))):
            n = P.parse_attempt_name(o.key.rsplit("/", 1)[-1])
            if n is None:
                continue
            cached = self._attempt_cache.get(n)
            if cached is not None:
                out[n] = cached
                continue
            try:
                out[n] = self._attempt_cache[n] = P.AttemptRecord.decode(self._get(o.key), self._where(o.key))
            except NotFoundError:
                continue
            except CorruptionError:
                # An unreadable attempt record still fences: treat it as a fresh start.
                out[n] = P.AttemptRecord(self.run_id, n, None, "?", o.mtime)
        return out

    def attempts(self) -> list[P.AttemptRecord]:
        """Every registered attempt, oldest first."""
        return [r for _, r in sorted(self._load_attempts().items())]

    def _register_attempt(self, resume_from: ResumeFrom) -> None:
        abandons: list[int] = []
        for _ in range(16):
            attempts = self._load_attempts()
            below = max(attempts, default=0) + 1
            if resume_from == "latest":
                ref = self._select(deep=self._resume_deep, attempts=attempts).latest
                r: int | None = ref.step if ref else None
            else:
                ref, r = None, resume_from
            rec = P.AttemptRecord(
                self.run_id, below, r, self.writer_id, P.now(), tuple(abandons), socket.gethostname()
            )
            if not self._create(P.attempt_key(self.run_id, below), rec.encode(), what="attempt record"):
                continue  # another process took this number; try the next one
            if resume_from == "latest":
                # A commit that landed between our selection and our registration
                # (an older writer that did not see us yet) must be adopted, not
                # silently superseded: re-select ignoring ourselves.
                earlier = {n: a for n, a in self._load_attempts().items() if n < below}
                again = self._select(deep=self._resume_deep, attempts=earlier)
                if (again.latest.save_id if again.latest else None) != (ref.save_id if ref else None):
                    abandons.append(below)
                    continue
            self.attempt = rec
            self.resumed_from = ref
            return
        raise StoreUnavailableError(
            f"run {self.run_id!r}: could not register an attempt after 16 tries (many concurrent writers?)"
        )

    def _check_not_superseded(self, step: int, *, committed: bool) -> None:
        assert self.attempt is not None
        later = superseded_by(step, self.attempt.number, effective_attempts(self._load_attempts()))
        if later is not None:
            what = "was committed but will never be selected" if committed else "was not committed"
            raise SupersededError(
                f"run {self.run_id!r}: this writer (attempt {self.attempt.number}) is superseded: "
                f"{describe_superseder(later)}. The save of step {step} {what}. Stop this process; "
                "the newer attempt owns the run.",
                committed=committed,
            )

    # ---------------------------------------------------------------- create
    def _create(self, key: str, data: bytes, *, what: str) -> bool:
        """Create-if-absent with retries and the lost-acknowledgement read-back.

        Returns True if *our* bytes are now at ``key`` (created by this call or
        by an earlier try whose reply was lost), False if someone else's are.
        """
        uncertain = False
        for i in range(self._retry.attempts):
            try:
                created = self.backend.create(key, data)
            except TransientError as exc:
                uncertain = True
                if i == self._retry.attempts - 1:
                    raise CommitUnknownError(
                        f"{self._where(key)}: the {what} create failed {self._retry.attempts} times ({exc}); "
                        "it may or may not have landed. Treat this save as not acknowledged."
                    ) from exc
                time.sleep(min(self._retry.max_delay, self._retry.base_delay * 2**i))
                continue
            if created:
                return True
            # "Already exists": ours from a lost reply, or another writer's?
            try:
                existing = self._get(key)
            except (NotFoundError, StoreUnavailableError) as exc:
                if uncertain:
                    raise CommitUnknownError(
                        f"{self._where(key)}: the {what} exists but cannot be read back ({exc}); "
                        "its outcome is unknown. Treat this save as not acknowledged."
                    ) from exc
                raise
            return existing == data
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, metadata: Mapping[str, Any] | None = None, expect: list[str] | None = None) -> SaveWriter:
        """Begin a save of ``step``; use as ``with store.save(step) as s: s.put(name, data)``.

        Leaving the block normally verifies the inventory (every ``put`` landed
        with its size; every name in ``expect`` present) and publishes the commit
        record with the backend's create-if-absent. An exception inside the
        block aborts: nothing is published and the written components are
        removed (best effort; ``gc`` removes what a killed process left).
        """
        if self.mode != "w" or self.attempt is None:
            raise InvalidInputError("this store was opened read-only; open it with identity=... to save")
        P.validate_step(step)
        md = dict(metadata or {})
        try:
            P.encode_record(md)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"save metadata must be JSON-representable: {exc}") from None
        for n in expect or []:
            P.validate_component_name(n)
        return SaveWriter(self, step, md, list(expect or []))

    # ------------------------------------------------------------- selection
    def _load_commit(self, step: int, attempt: int) -> P.CommitRecord:
        key = P.commit_key(self.run_id, step, attempt)
        rec = P.CommitRecord.decode(self._get(key), self._where(key))
        if rec.step != step or rec.attempt != attempt or rec.run_id != self.run_id:
            raise CorruptionError(f"{self._where(key)}: record names step {rec.step}, attempt {rec.attempt}")
        if P.parse_save_id(rec.save_id) is None:
            raise CorruptionError(f"{self._where(key)}: malformed save_id {rec.save_id!r}")
        return rec

    def _check_components(
        self, rec: P.CommitRecord, listed: Mapping[str, ObjectInfo] | None, deep: bool
    ) -> list[tuple[SkipReason, str]]:
        problems: list[tuple[SkipReason, str]] = []
        for name, comp in sorted(rec.components.items()):
            key = P.component_key(self.run_id, rec.save_id, name)
            if listed is not None:
                info = listed.get(name)
                size = info.size if info is not None else None
            else:
                try:
                    size = self._retry.call(lambda k=key: self.backend.size(k))  # type: ignore[misc]
                except NotFoundError:
                    size = None
            if size is None:
                problems.append((SkipReason.MISSING_COMPONENT, f"component {name!r} is missing"))
                continue
            if size != comp.size:
                problems.append(
                    (SkipReason.SIZE_MISMATCH, f"component {name!r} has {size} bytes, record says {comp.size}")
                )
                continue
            if deep:
                try:
                    digest = self._hash_object(key, comp.size)
                except NotFoundError:
                    problems.append((SkipReason.MISSING_COMPONENT, f"component {name!r} vanished while hashing"))
                    continue
                if digest != comp.blake3:
                    problems.append((SkipReason.HASH_MISMATCH, f"component {name!r} BLAKE3 does not match the record"))
        return problems

    def _hash_object(self, key: str, size: int) -> str:
        h = blake3.blake3()
        for chunk in self._iter_object(key, size):
            h.update(chunk)
        return h.hexdigest()

    def _iter_object(self, key: str, size: int, chunk: int = CHUNK) -> Iterator[bytes]:
        if size <= chunk:
            yield self._get(key)
            return
        for off in range(0, size, chunk):
            end = min(size, off + chunk)
            yield self._retry.call(lambda o=off, e=end: self.backend.get_range(key, o, e))  # type: ignore[misc]

    def _ref(self, rec: P.CommitRecord) -> SaveRef:
        return SaveRef(self.run_id, rec.step, rec.attempt, rec.save_id, rec, rec.manifest_digest())

    def _evaluate(
        self, step: int, attempt: int, scan: _Scan, deep: bool
    ) -> tuple[SaveRef | None, list[tuple[SkipReason, str]], str | None]:
        """Check one commit: (ref if it verifies, problems, save_id if known)."""
        later = superseded_by(step, attempt, scan.effective)
        try:
            rec = self._load_commit(step, attempt)
        except P.UnsupportedVersion as exc:
            return None, [(SkipReason.UNSUPPORTED_VERSION, str(exc))], None
        except NotFoundError:
            return None, [(SkipReason.UNREADABLE_RECORD, "commit record vanished while reading")], None
        except CorruptionError as exc:
            return None, [(SkipReason.UNREADABLE_RECORD, str(exc))], None
        if later is not None:
            return None, [(SkipReason.SUPERSEDED, describe_superseder(later))], rec.save_id
        if rec.identity_digest != self.identity_digest:
            return None, [(SkipReason.IDENTITY_MISMATCH, "commit was made under another identity")], rec.save_id
        problems = self._check_components(rec, scan.save_objects.get(rec.save_id, {}), deep)
        if problems:
            return None, problems, rec.save_id
        return self._ref(rec), [], rec.save_id

    def _select(self, deep: bool, attempts: Mapping[int, P.AttemptRecord] | None = None) -> Selection:
        scan = _Scan(self)
        if attempts is not None:
            scan.attempts = dict(attempts)
            scan.effective = effective_attempts(scan.attempts)
        skipped: list[Skip] = []
        committed_ids: set[str] = set()
        chosen: SaveRef | None = None
        for step, attempt in candidate_order(scan.commits):
            ref, problems, save_id = self._evaluate(step, attempt, scan, deep)
            if save_id:
                committed_ids.add(save_id)
            if ref is not None:
                chosen = ref
                break
            skipped.append(Skip(step, attempt, save_id, problems[0][0], "; ".join(d for _, d in problems)))
        # Uncommitted saves newer than the choice are candidates too.
        # (Their save IDs carry step and attempt.)
        for sid in scan.save_objects:
            if sid in committed_ids:
                continue
            sa = P.parse_save_id(sid)
            if sa is None:
                continue
            s, a = sa
            if chosen is None or (s, a) > (chosen.step, chosen.attempt):
                n = len(scan.save_objects[sid])
                skipped.append(Skip(s, a, sid, SkipReason.NO_COMMIT, f"{n} component(s) written, no commit record"))
        skipped.sort(key=lambda k: (k.step, k.attempt), reverse=True)
        return Selection(chosen, skipped)

    @overload
    def latest_complete(self, deep: bool = ..., *, explain: Literal[False] = ...) -> SaveRef | None: ...
    @overload
    def latest_complete(self, deep: bool = ..., *, explain: Literal[True]) -> Selection: ...

    def latest_complete(self, deep: bool = False, *, explain: bool = False) -> SaveRef | Selection | None:
        """The newest committed save that verifies, or None.

        Never a partial, corrupt or superseded save. The default check reads the
        commit record and compares every component's size by listing (no data
        read); ``deep=True`` also re-hashes every byte. With ``explain=True``
        the answer is a :class:`Selection` that also lists every newer candidate
        that was skipped and why.
        """
        sel = self._select(deep)
        return sel if explain else sel.latest

    # -------------------------------------------------------------- reading
    def _component(self, ref: SaveRef, name: str) -> tuple[str, P.ComponentEntry]:
        if ref.run_id != self.run_id:
            raise InvalidInputError(f"save {ref.save_id} belongs to run {ref.run_id!r}, not {self.run_id!r}")
        comp = ref.components.get(name)
        if comp is None:
            raise NotFoundError(
                f"save {ref.save_id} (step {ref.step}) has no component {name!r}; "
                f"it has: {', '.join(sorted(ref.components)) or 'none'}"
            )
        return P.component_key(self.run_id, ref.save_id, name), comp

    def read(self, ref: SaveRef, name: str) -> bytes:
        """The component's bytes, verified against the commit record's size and
        BLAKE3 digest. A mismatch raises :class:`CorruptionError`; bad bytes are
        never returned."""
        return b"".join(self.iter_read(ref, name))

    def iter_read(self, ref: SaveRef, name: str, chunk: int = CHUNK) -> Iterator[bytes]:
        """Stream a component in chunks, verifying as it goes.

        The size is checked on every chunk and the digest when the last chunk
        has been read: the final chunk is yielded only after the whole
        component verified, so a consumer that reaches the end of the iterator
        has seen only verified bytes; on a mismatch :class:`CorruptionError` is
        raised instead of the last chunk. Do not act on the data before the
        iterator is exhausted.
        """
        key, comp = self._component(ref, name)
        h = blake3.blake3()
        got = 0
        held: bytes | None = None
        try:
            for block in self._iter_object(key, comp.size, chunk):
                got += len(block)
                if got > comp.size:
                    break
                h.update(block)
                if held is not None:
                    yield held
                held = block
        except NotFoundError:
            raise CorruptionError(
                f"{self._where(key)}: component {name!r} of save {ref.save_id} is missing"
            ) from None
        if got != comp.size:
            raise CorruptionError(
                f"{self._where(key)}: component {name!r} has {got}+ bytes, the commit record says {comp.size}"
            )
        if h.hexdigest() != comp.blake3:
            raise CorruptionError(
                f"{self._where(key)}: component {name!r} of save {ref.save_id} does not match its BLAKE3 digest"
            )
        if held is not None:
            yield held

    def verify(self, ref: SaveRef, *, deep: bool = True) -> VerifyReport:
        """Check one save against its record (sizes; with ``deep`` every digest)."""
        report = VerifyReport(ref, deep)
        later = superseded_by(ref.step, ref.attempt, effective_attempts(self._load_attempts()))
        if later is not None:
            report.problems.append((SkipReason.SUPERSEDED, describe_superseder(later)))
        try:
            current = self._load_commit(ref.step, ref.attempt)
        except (NotFoundError, CorruptionError) as exc:
            report.problems.append((SkipReason.UNREADABLE_RECORD, str(exc)))
            return report
        if current.encode() != ref.record.encode():
            report.problems.append((SkipReason.UNREADABLE_RECORD, "commit record changed since it was read"))
        report.problems.extend(self._check_components(current, None, deep))
        return report

    def get_save(self, step: int, attempt: int | None = None) -> SaveRef:
        """The commit of ``step`` (the highest attempt, unless given); not verified."""
        scan = _Scan(self)
        attempts = sorted(a for s, a in scan.commits if s == step and (attempt is None or a == attempt))
        if not attempts:
            raise NotFoundError(f"run {self.run_id!r} has no commit for step {step}")
        return self._ref(self._load_commit(step, attempts[-1]))

    # -------------------------------------------------------------- listing
    def list_saves(self, *, deep: bool = False, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> list[SaveInfo]:
        """Every save of the run (committed or not), newest first, with its state."""
        return self._list_saves(_Scan(self), deep, grace_seconds)

    def _list_saves(self, scan: _Scan, deep: bool, grace_seconds: float) -> list[SaveInfo]:
        latest: SaveRef | None = None  # the first commit that verifies, in candidate order
        out: list[SaveInfo] = []
        committed_ids: set[str] = set()
        seen_steps: set[int] = set()
        for step, attempt in candidate_order(scan.commits):
            ref, problems, sid = self._evaluate(step, attempt, scan, deep)
            if ref is not None and step in seen_steps:
                problems = [(SkipReason.SUPERSEDED, f"step {step} was committed again by a later attempt")]
                ref = None
            if ref is not None:
                seen_steps.add(step)
                if latest is None:
                    latest = ref
            if sid:
                committed_ids.add(sid)
            objs = scan.save_objects.get(sid or "", {})
            if ref is not None:
                state, detail = SaveState.COMMITTED, "verified" if deep else "sizes verified"
            elif problems[0][0] is SkipReason.SUPERSEDED:
                state, detail = SaveState.SUPERSEDED, problems[0][1]
            elif problems[0][0] is SkipReason.UNSUPPORTED_VERSION:
                state, detail = SaveState.UNSUPPORTED, problems[0][1]
            else:
                state, detail = SaveState.CORRUPT, "; ".join(d for _, d in problems)
            out.append(
                SaveInfo(
                    sid or "?",
                    step,
                    attempt,
                    state,
                    detail,
                    sum(o.size for o in objs.values()),
                    len(objs),
                    scan.commits[(step, attempt)].mtime,
                    selected=latest is not None and ref is not None and ref.save_id == latest.save_id,
                    ref=ref,
                )
            )
        now = time.time()
        for sid, objs in scan.save_objects.items():
            if sid in committed_ids:
                continue
            sa = P.parse_save_id(sid) or (-1, -1)
            newest = max(o.mtime for o in objs.values())
            state = uncommitted_state(now - newest, grace_seconds)
            detail = f"{len(objs)} component(s) written, no commit record; last write {now - newest:.0f}s ago"
            later = superseded_by(sa[0], sa[1], scan.effective) if sa[0] >= 0 else None
            if later is not None:
                # its writer was replaced before this step: it can never be committed
                state = SaveState.PARTIAL
                detail = f"abandoned ({describe_superseder(later)}); {detail}"
            out.append(
                SaveInfo(
                    sid,
                    sa[0],
                    sa[1],
                    state,
                    detail,
                    sum(o.size for o in objs.values()),
                    len(objs),
                    None,
                )
            )
        out.sort(key=lambda i: (i.step, i.attempt), reverse=True)
        return out

    # ------------------------------------------------------------------- gc
    def gc(
        self,
        *,
        keep_last: int = 2,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        dry_run: bool = False,
        deep: bool = True,
    ) -> GcReport:
        """Delete what no future resume can need, keeping invariant 4.

        Kept, always: the newest complete save; the ``keep_last`` newest
        complete saves; any uncommitted save whose last write is younger than
        ``grace_seconds`` (it may be in flight); corrupt commits (evidence for an
        operator; delete them by hand); records of a newer protocol version.
        With ``deep`` (the default) every commit is re-hashed before anything is
        deleted, so a save with an undetected bit flip never counts as the
        newest complete one and the last good save behind it survives; this
        reads every committed byte. ``deep=False`` checks sizes only.
        Deleted: older complete saves, superseded saves, uncommitted saves
        older than the grace period, and temporary files that killed writers
        left behind (local disk) older than the grace period. A committed save loses its commit record
        *before* its components, so no crash during gc leaves a commit pointing
        at deleted bytes.
        """
        from .gc import plan_gc

        if keep_last < 1:
            raise InvalidInputError("keep_last must be at least 1: the newest complete save is never deleted")
        if grace_seconds < 0:
            raise InvalidInputError("grace_seconds must be >= 0")
        scan = _Scan(self)
        infos = self._list_saves(scan, deep, grace_seconds)
        plan = plan_gc(infos, keep_last=keep_last)
        actions: list[GcAction] = []
        for info, reason in plan.delete:
            if info.state in (SaveState.COMMITTED, SaveState.SUPERSEDED):
                actions.append(GcAction(P.commit_key(self.run_id, info.step, info.attempt), reason))
            for name in sorted(scan.save_objects.get(info.save_id, {})):
                actions.append(GcAction(P.component_key(self.run_id, info.save_id, name), reason))
        temp = self.backend.stale_temporaries(P.run_prefix(self.run_id), time.time() - grace_seconds)
        if not dry_run:
            for act in actions:
                self._retry.call(lambda k=act.key: self.backend.delete(k))  # type: ignore[misc]
            for t in temp:
                self.backend.remove_temporary(t)
        return GcReport(
            dry_run,
            [i.save_id for i in plan.keep],
            [(i.save_id, r) for i, r in plan.delete],
            actions,
            temp,
        )

    def lineage_of(self, ref: SaveRef) -> dict[str, Any]:
        """The lineage record for starting a *new* run from this save's weights
        (``CheckpointStore.open(url, new_run_id, identity=..., lineage=store.lineage_of(ref))``).
        The new run is never a continuation of this one."""
        return {
            "source_url": self.backend.url,
            "source_run": self.run_id,
            "save_id": ref.save_id,
            "step": ref.step,
            "manifest_digest": ref.manifest_digest,
        }

    # --------------------------------------------------------------- events
    def record_event(self, kind: str, payload: Mapping[str, Any]) -> str:
        """Append an event to the run's ledger (created exclusively, never overwritten).

        The one write a read-only store may make, when asked: an operator (or a
        job refused before it registered an attempt) records what happened."""
        if not kind or not kind.replace("-", "").replace("_", "").isalnum():
            raise InvalidInputError(f"event kind {kind!r} must be alphanumeric with '-' or '_'")
        ts = P.now()
        key = f"{P.events_prefix(self.run_id)}{int(ts * 1e6):020d}-{kind}-{uuid.uuid4().hex[:8]}.json"
        rec = {
            "protocol_version": P.PROTOCOL_VERSION,
            "kind": "event",
            "event": kind,
            "at": ts,
            "attempt": self.attempt.number if self.attempt else None,
            "payload": dict(payload),
        }
        try:
            data = P.encode_record(rec)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"event payload must be JSON-representable: {exc}") from None
        self._create(key, data, what="event")
        return key

    def events(self) -> list[dict[str, Any]]:
        """The run's ledger, oldest first (unreadable entries are skipped)."""
        out = []
        for o in self._retry.call(lambda: self.backend.list(P.events_prefix(self.run_id))):
            try:
                out.append(P.decode_record(self._get(o.key), kind="event", where=self._where(o.key)))
            except (NotFoundError, CorruptionError):
                continue
        return out

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        att = self.attempt.number if self.attempt else None
        return f"CheckpointStore({self.backend.url!r}, run_id={self.run_id!r}, mode={self.mode!r}, attempt={att})"


class SaveWriter:
    """One save in progress. Created by :meth:`CheckpointStore.save`."""

    def __init__(self, store: CheckpointStore, step: int, metadata: dict[str, Any], expect: list[str]) -> None:
        assert store.attempt is not None
        self.store = store
        self.step = step
        self.metadata = metadata
        self.expect = expect
        self.save_id = P.new_save_id(step, store.attempt.number)
        self._components: dict[str, P.ComponentEntry] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: The published save, set when the ``with`` block exits cleanly.
        self.ref: SaveRef | None = None

    def __enter__(self) -> SaveWriter:
        return self

    def put(self, name: str, data: Any) -> P.ComponentEntry:
        """Write one component, hashing it with BLAKE3 while it is written.

        ``data``: bytes-like (bytes, bytearray, memoryview, numpy array, ...), a
        binary file object, or an iterable of bytes-like buffers.
        """
        if self._closed:
            raise InvalidInputError("this save is already closed")
        P.validate_component_name(name)
        check_data(data)
        with self._lock:
            if name in self._components:
                raise InvalidInputError(f"component {name!r} was already written in this save")
            for other in self._components:
                if other.startswith(name + "/") or name.startswith(other + "/"):
                    raise InvalidInputError(f"component {name!r} clashes with {other!r} (a name cannot be a folder)")
            self._components[name] = P.ComponentEntry(name, -1, "")  # reserve
        key = P.component_key(self.store.run_id, self.save_id, name)
        replayable = is_replayable(data)
        policy = self.store._retry
        try:
            for i in range(policy.attempts):
                stream = HashingStream(data)
                try:
                    self.store.backend.put(key, stream)
                    break
                except TransientError:
                    if not replayable or i == policy.attempts - 1:
                        raise
                    rewind(data)
                    time.sleep(min(policy.max_delay, policy.base_delay * 2**i))
            entry = P.ComponentEntry(name, stream.size, stream.hexdigest())
        except BaseException:
            with self._lock:
                self._components.pop(name, None)
            raise
        with self._lock:
            self._components[name] = entry
        return entry

    @property
    def components(self) -> dict[str, P.ComponentEntry]:
        return dict(self._components)

    def _abort(self) -> None:
        self._closed = True
        for name in list(self._components):
            try:
                self.store.backend.delete(P.component_key(self.store.run_id, self.save_id, name))
            except Exception:  # noqa: BLE001 - best effort; gc removes leftovers
                pass

    def _verify_inventory(self, comps: dict[str, P.ComponentEntry]) -> None:
        """Every component is there with the size we wrote (read-after-write)."""
        store = self.store
        prefix = P.save_prefix(store.run_id, self.save_id)
        listed = {o.key[len(prefix) :]: o for o in store._retry.call(lambda: store.backend.list(prefix))}
        for n, c in comps.items():
            o = listed.get(n)
            if o is None or o.size != c.size:
                raise SaveAbortedError(
                    f"save of step {self.step}: component {n!r} did not land intact "
                    f"({'missing' if o is None else f'{o.size} bytes, wrote {c.size}'}); nothing was published"
                )

    def commit(self) -> SaveRef:
        """Verify the inventory and publish. Called by a clean ``with`` exit."""
        if self._closed:
            raise InvalidInputError("this save is already closed")
        store = self.store
        assert store.attempt is not None
        self._closed = True
        comps = dict(self._components)
        pending = [n for n, c in comps.items() if c.size < 0]
        if pending:
            raise SaveAbortedError(f"components still being written at commit: {pending}")
        missing = [n for n in self.expect if n not in comps]
        if missing:
            self._abort()
            raise SaveAbortedError(
                f"save of step {self.step} is incomplete: expected component(s) {missing} were never written; "
                "nothing was published"
            )
        if not comps:
            raise SaveAbortedError(f"save of step {self.step} has no components; nothing was published")
        try:
            self._verify_inventory(comps)
            store._check_not_superseded(self.step, committed=False)
        except BaseException:
            # nothing was published: remove what this save wrote (best effort)
            self._abort()
            raise
        record = P.CommitRecord(
            run_id=store.run_id,
            step=self.step,
            attempt=store.attempt.number,
            save_id=self.save_id,
            writer_id=store.writer_id,
            identity_digest=store.identity_digest,
            components=comps,
            created_at=P.now(),
            metadata=self.metadata,
        )
        data = record.encode()
        key = P.commit_key(store.run_id, self.step, store.attempt.number)
        if not store._create(key, data, what="commit record"):
            self._abort()
            raise CommitConflictError(
                f"run {store.run_id!r}: step {self.step} was already committed by another writer of "
                f"attempt {store.attempt.number}; this save ({self.save_id}) was not published"
            )
        try:
            store._check_not_superseded(self.step, committed=True)
        except SupersededError:
            raise
        except (StoreUnavailableError, CorruptionError) as exc:
            # The record landed, but whether a newer attempt fenced us off cannot be told.
            raise CommitUnknownError(
                f"run {store.run_id!r}: the commit record of step {self.step} landed, but the post-commit fence "
                f"check failed ({exc}); treat the save as not acknowledged — latest_complete() tells whether "
                "it is selectable"
            ) from exc
        self.ref = store._ref(record)
        return self.ref

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            if not self._closed:
                self._abort()
            return
        self.commit()
