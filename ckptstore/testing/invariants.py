"""Raw invariant checks for fault-injection tests: read the store through the
:class:`~ckptstore.backends.base.Backend` interface only, never through the
store's own selection (which, by design, quietly skips a broken commit).

Invariant 1 (PROTOCOL.md §6, "complete before visible"): every commit record
in a run names components that are *all* present with exactly the recorded
size and BLAKE3 digest. ``latest_complete()`` falls back past a commit whose
bytes are missing, so a suite that only looks at the selection cannot see a
commit published before its components landed, or a gc that deleted the
components before the record. These helpers can.

The record layout is read as plain JSON (keys documented in PROTOCOL.md §1–2)
so the checks do not depend on the store's internal record classes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

import blake3

from ..backends.base import Backend
from ..errors import NotFoundError

# ASCII digits only, whole names (PROTOCOL.md §1: one spelling per name); a
# match counts only if the name is the canonical one of its parsed numbers
_COMMIT_NAME = re.compile(r"([0-9]{12})\.([0-9]{8})\.json", re.ASCII)  # a version-1 run (oldest first)
# a version-2 run (newest first): inverted step and attempt, then the plain ones
_COMMIT_NAME_V2 = re.compile(r"[0-9]{12}\.[0-9]{8}-([0-9]{12})\.([0-9]{8})\.json", re.ASCII)
_ATTEMPT_NAME = re.compile(r"([0-9]{8})\.json", re.ASCII)


def _commit_name(version: int, step: int, attempt: int) -> str:
    plain = f"{step:012d}.{attempt:08d}.json"
    return plain if version < 2 else f"{10**12 - 1 - step:012d}.{10**8 - 1 - attempt:08d}-{plain}"


@dataclass(frozen=True)
class RawCommit:
    """One commit record as stored: its key, (step, attempt) and decoded JSON."""

    key: str
    step: int
    attempt: int
    record: dict[str, Any] | None  # None: unreadable
    problem: str = ""

    @property
    def save_id(self) -> str | None:
        sid = (self.record or {}).get("save_id")
        return sid if isinstance(sid, str) else None


def raw_commits(backend: Backend, run_id: str, *, skip: Container[str] = ()) -> list[RawCommit]:
    """Every commit record of ``run_id`` (but those whose key is in ``skip``),
    oldest step first, read raw."""
    out: list[RawCommit] = []
    prefix = f"{run_id}/commits/"
    version = _run_version(backend, run_id)
    name = _COMMIT_NAME_V2 if version >= 2 else _COMMIT_NAME
    for o in backend.list(prefix):
        m = name.fullmatch(o.key[len(prefix) :])
        if m is None or o.key in skip:
            continue
        step, attempt = int(m.group(1)), int(m.group(2))
        if attempt < 1 or o.key != prefix + _commit_name(version, step, attempt):
            continue  # another spelling of a real commit's name: not a commit record
        try:
            data = backend.get(o.key)
        except NotFoundError:
            continue  # deleted between the listing and the read (gc running)
        try:
            rec = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            out.append(RawCommit(o.key, step, attempt, None, f"unreadable record: {exc}"))
            continue
        if not isinstance(rec, dict):
            out.append(RawCommit(o.key, step, attempt, None, "unreadable record: not a JSON object"))
            continue
        out.append(RawCommit(o.key, step, attempt, rec))
    out.sort(key=lambda c: (c.step, c.attempt))
    return out


def _run_version(backend: Backend, run_id: str) -> int:
    """The protocol version in the run's RUN.json (it fixes how commits are named)."""
    try:
        rec = json.loads(backend.get(f"{run_id}/RUN.json").decode("utf-8"))
    except (NotFoundError, UnicodeDecodeError, ValueError):
        return 1
    version = rec.get("protocol_version") if isinstance(rec, dict) else None
    return version if isinstance(version, int) else 1


def _digest(backend: Backend, key: str) -> tuple[int, str]:
    data = backend.get(key)
    return len(data), blake3.blake3(data).hexdigest()


def invariant_1_violations(backend: Backend, run_id: str, *, known_good: set[str] | None = None) -> list[str]:
    """Invariant 1, checked raw: for every commit record of the run, every
    component it lists exists with the recorded size and BLAKE3 digest — a
    component stored as pieces (protocol version 3: ``"pieces": [[holder,
    digest, size], ...]``) as every piece at ``<run>/pieces/<holder>/<digest>``
    with its size and BLAKE3, each distinct piece read once.

    Returns one line per violation (empty: the invariant holds). A record of a
    newer protocol version is not judged (it may use another layout); an
    unreadable record is a violation (a commit is created atomically, so a
    torn record means the commit primitive failed).

    ``known_good`` (for long soaks): commit keys verified earlier are not read
    again, and every key that verifies now is added. Only sound while nothing
    may delete a verified save's components (clear it after a gc).
    """
    problems: list[str] = []
    pieces_seen: dict[str, tuple[int, str] | None] = {}  # piece key -> (size, digest); None: missing
    for c in raw_commits(backend, run_id, skip=known_good if known_good is not None else ()):
        where = f"commit {c.key}"
        before = len(problems)
        if c.record is None:
            problems.append(f"{where}: {c.problem}")
            continue
        version = c.record.get("protocol_version")
        if isinstance(version, int) and version > 3:
            continue
        comps = c.record.get("components")
        sid = c.save_id
        if not isinstance(comps, Mapping) or not comps or sid is None:
            problems.append(f"{where}: record has no save_id or no components")
            continue
        for name, entry in sorted(comps.items()):
            pieces = entry.get("pieces") if isinstance(entry, Mapping) else None
            if pieces is not None:
                problems += _pieces_violations(backend, run_id, where, name, pieces, pieces_seen)
                continue
            key = f"{run_id}/saves/{sid}/{name}"
            try:
                size, digest = _digest(backend, key)
            except NotFoundError:
                problems.append(f"{where}: component {name!r} is MISSING ({key})")
                continue
            want_size = entry.get("size") if isinstance(entry, Mapping) else None
            want_digest = entry.get("blake3") if isinstance(entry, Mapping) else None
            if size != want_size:
                problems.append(f"{where}: component {name!r} has {size} bytes, the record says {want_size}")
            elif digest != want_digest:
                problems.append(f"{where}: component {name!r} does not match its recorded BLAKE3")
        if known_good is not None and len(problems) == before:
            known_good.add(c.key)
    return problems


def _pieces_violations(backend: Backend, run_id: str, where: str, name: str, pieces: object,
                       seen: dict[str, tuple[int, str] | None]) -> list[str]:
    if not isinstance(pieces, list):
        return [f"{where}: component {name!r} has a malformed piece list"]
    out: list[str] = []
    for p in pieces:
        if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[1], str)):
            out.append(f"{where}: component {name!r} has a malformed piece entry")
            continue
        holder, digest, want = p
        key = f"{run_id}/pieces/{holder}/{digest}"
        if key not in seen:
            try:
                seen[key] = _digest(backend, key)
            except NotFoundError:
                seen[key] = None
        got = seen[key]
        if got is None:
            out.append(f"{where}: component {name!r}: piece {digest[:16]} of save {holder} is MISSING ({key})")
        elif got[0] != want:
            out.append(f"{where}: component {name!r}: piece {digest[:16]} has {got[0]} bytes, the record says {want}")
        elif got[1] != digest:
            out.append(f"{where}: component {name!r}: piece {digest[:16]} does not match its BLAKE3")
    return out


def assert_invariant_1(backend: Backend, run_id: str, context: str = "") -> None:
    """Raise AssertionError listing every commit without all its bytes."""
    bad = invariant_1_violations(backend, run_id)
    if bad:
        head = f"invariant 1 violated (a commit record without all its bytes){': ' + context if context else ''}"
        raise AssertionError(head + "\n  " + "\n  ".join(bad))


def commits_of_step(backend: Backend, run_id: str, step: int) -> list[RawCommit]:
    """Every commit record of one step (any attempt)."""
    return [c for c in raw_commits(backend, run_id) if c.step == step]


def raw_attempts(backend: Backend, run_id: str) -> dict[int, dict[str, Any]]:
    """Every attempt record of the run, by number, read raw."""
    out: dict[int, dict[str, Any]] = {}
    prefix = f"{run_id}/attempts/"
    for o in backend.list(prefix):
        m = _ATTEMPT_NAME.fullmatch(o.key[len(prefix) :])
        if m is None or o.key != f"{prefix}{int(m.group(1)):08d}.json":
            continue
        try:
            rec = json.loads(backend.get(o.key).decode("utf-8"))
        except (NotFoundError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(rec, dict):
            out[int(m.group(1))] = rec
    return out


def save_objects(backend: Backend, run_id: str) -> dict[str, list[str]]:
    """Objects under ``saves/``, grouped by save ID."""
    out: dict[str, list[str]] = {}
    prefix = f"{run_id}/saves/"
    for o in backend.list(prefix):
        rest = o.key[len(prefix) :]
        if "/" in rest:
            sid, name = rest.split("/", 1)
            out.setdefault(sid, []).append(name)
    return out
