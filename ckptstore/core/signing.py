"""Signing an existing run's records after the fact (``ckptstore sign``):
each save is re-hashed first, and only what verifies is signed. Tags go to
sidecar objects (records are immutable), see :mod:`ckptstore.core.record_auth`.

A signature vouches for a record, so ``sign`` signs only records that are
consistent with the run's history (protocol_spec/THREATS.md §4.7):

* an attempt record whose ``resumed_from`` names a save of an earlier attempt
  that verifies, or that started from scratch while no earlier attempt has a
  save that verifies — or, failing that, one that is *harmless*: signing it
  supersedes no verified save the other accepted attempts leave standing and
  un-abandons none of them (:func:`attempt_refusal`, pure);
* a commit record whose save re-hashes intact and whose attempt is registered
  and accepted;
* an event whose attempt (if it names one) is registered and accepted.

Everything else — a planted fresh start, a torn record, a junk sidecar at a
record's tag — is reported with its reason and skipped; it never stops the
signing of the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import CkptStoreError, CorruptionError, InvalidInputError, NotFoundError
from ..protocol import (
    AttemptRecord,
    EventRecord,
    attempt_key,
    attempt_of_key,
    attempts_prefix,
    events_prefix,
    run_record_key,
)
from ..protocol.records import MAX_ATTEMPT_RECORD, MAX_EVENT_RECORD, Signable
from ..protocol.selection import effective_attempts, superseded_by
from .binding import read_run_record
from .catalog import Catalog
from .record_auth import ENV_KEYS, sidecar_key

#: Steps named in a refusal before the rest are counted.
_NAMED_STEPS = 5


@dataclass
class SignReport:
    """What ``sign`` did: record keys signed, already authenticated, and
    refused (key -> why it was not signed, with the way out)."""

    signed: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    #: record key -> why it was not signed
    refused: dict[str, str] = field(default_factory=dict)


def _steps(pairs: Iterable[tuple[int, int]]) -> str:
    steps = sorted({s for s, _ in pairs}, reverse=True)
    more = f" and {len(steps) - _NAMED_STEPS} more" if len(steps) > _NAMED_STEPS else ""
    return ", ".join(map(str, steps[:_NAMED_STEPS])) + more


def attempt_refusal(
    rec: AttemptRecord, verified: Iterable[tuple[int, int]], accepted: Mapping[int, AttemptRecord]
) -> str | None:
    """Why signing attempt ``rec`` would vouch for a history the run's saves
    contradict (None: it may be signed). Pure.

    ``verified``: (step, attempt) of every commit whose save re-hashes intact;
    ``accepted``: the other attempts that are (or will be) authenticated.
    Consistent: ``resumed_from`` names a verified save of an earlier attempt,
    or the attempt started from scratch and no earlier attempt has a verified
    save. An inconsistent record is still signed when it is harmless: every
    verified save it would supersede is already superseded by an accepted
    attempt, and it abandons none of them."""
    n, r = rec.number, rec.resumed_from
    earlier = [(s, a) for s, a in verified if a < n]
    if r is None and not earlier:
        return None
    if r is not None and any(s == r for s, _ in earlier):
        return None
    others = {k: v for k, v in accepted.items() if k != n}
    if set(rec.abandons) & set(others):
        return (f"attempt {n} abandons attempt(s) {sorted(set(rec.abandons) & set(others))} and its resume point "
                "is not a save that verifies: not signed")
    eff = effective_attempts(others)
    hit = [(s, a) for s, a in earlier if (r is None or r < s) and superseded_by(s, a, eff) is None]
    if not hit:
        return None
    claim = "from scratch" if r is None else f"from step {r}, which is not a save of an earlier attempt that verifies"
    return (f"attempt {n} claims to have restarted the run {claim}; signed, it would supersede the verified "
            f"save(s) at step(s) {_steps(hit)}: not signed (unsigned, it fences nothing under auth_policy=require). "
            f"If the restart was genuine, remove or keep the saves it superseded by hand")


def sign_run(catalog: Catalog) -> SignReport:
    """Sign the run record, then every attempt, commit and event that is
    consistent with the run's history (module docstring); refuse the rest
    with the reason. Never raises for a bad record or sidecar."""
    io, auth = catalog.io, catalog.auth
    if auth.keyring is None or auth.keyring.active is None:
        raise InvalidInputError(f"signing needs a key: set {ENV_KEYS}=ID:HEX or pass a key file")
    rep = SignReport()

    def authentic(key: str, rec: Signable) -> bool:
        return auth.problem(rec, io.run_id, io, key) is None

    def one(key: str, rec: Signable) -> bool:
        """Sign one record; True if it is authenticated afterwards."""
        if authentic(key, rec):
            rep.already.append(key)
            return True
        try:
            created = auth.sign_existing(io, key, rec)
        except CkptStoreError as exc:  # e.g. something planted at the sidecar's key that is not an object
            rep.refused[key] = f"its tag could not be written to {sidecar_key(key)}: {exc}"
            return False
        if created:
            rep.signed.append(key)
            return True
        rep.refused[key] = (f"a sidecar {sidecar_key(key)} already exists and does not authenticate this record "
                            "(junk, or a tag by a key not configured here): not signed; remove that object and sign again")
        return False

    one(run_record_key(io.run_id), read_run_record(io))

    # the records as they are: attempts, and every commit with its save re-hashed
    attempts: dict[int, tuple[str, AttemptRecord]] = {}
    for o in io.list(attempts_prefix(io.run_id)):
        n = attempt_of_key(io.run_id, o.key)  # the canonical key only, never a twin
        if n is None:
            continue
        key = attempt_key(io.run_id, n)
        if o.key != key:  # another spelling of the number: not this attempt's record
            rep.refused[o.key] = f"not the name of attempt {n}'s record ({key}): not signed"
            continue
        try:
            attempts[n] = (key, AttemptRecord.decode(io.get_bounded(o.key, MAX_ATTEMPT_RECORD), o.key, number=n))
        except (CorruptionError, NotFoundError) as exc:
            rep.refused[o.key] = str(exc)
    scan = catalog.scan()
    commits: dict[tuple[int, int], tuple[str, Signable]] = {}
    for step, attempt in sorted(scan.commits, reverse=True):
        key = catalog.commit_key(step, attempt)
        try:
            crec = catalog.load_commit(step, attempt)
            problems = catalog.check_components(crec, None, deep=True)
        except (CorruptionError, NotFoundError) as exc:
            rep.refused[key] = str(exc)
            continue
        if problems:
            rep.refused[key] = "; ".join(d for _, d in problems)
            continue
        commits[(step, attempt)] = (key, crec)

    # which attempts may be vouched for: authentic already, consistent, or harmless
    verified = list(commits)
    consistent = {n: r for n, (k, r) in attempts.items() if authentic(k, r) or attempt_refusal(r, verified, {}) is None}
    accepted: set[int] = set()
    for n, (key, arec) in sorted(attempts.items()):
        why = None if n in consistent else attempt_refusal(arec, verified, consistent)
        if why is not None:
            rep.refused[key] = why
        elif one(key, arec):
            accepted.add(n)

    for (_step, attempt), (key, srec) in sorted(commits.items(), reverse=True):
        if attempt not in accepted:
            rep.refused[key] = (f"committed by attempt {attempt}, which is not registered or was not signed: "
                                "not signed")
            continue
        one(key, srec)
    for o in io.list(events_prefix(io.run_id)):
        try:
            ev = EventRecord.decode(io.get_bounded(o.key, MAX_EVENT_RECORD), o.key)
        except (CorruptionError, NotFoundError) as exc:
            rep.refused[o.key] = str(exc)
            continue
        if ev.attempt is not None and ev.attempt not in accepted:
            rep.refused[o.key] = f"names attempt {ev.attempt}, which is not registered or was not signed: not signed"
            continue
        one(o.key, ev)
    return rep
