"""Peer copies at resume (PROTOCOL.md §4.8 item 8, THREATS.md §4.16): what
each rank holds verified of other ranks' parts (:func:`peer_holdings`), the
plan of which save to resume and who sends whom their part
(:func:`plan_repair`, zombies judged by the durable attempt records), the
holder's side (:func:`send_held_part`) and the owner's write-back into its
own folder (:func:`write_back`, the durable records mirrored first, every
byte verified). No torch: the transport is a :class:`~.peer_frames.PeerLink`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backends.schemes import backend_from_url
from ..core.binding import read_run_record
from ..core.bounded_io import RunIO
from ..core.catalog import Catalog, part_names
from ..core.fencing import AttemptLog
from ..core.record_auth import RecordAuth
from ..errors import CkptStoreError, CorruptionError, NotFoundError
from ..protocol import AttemptRecord, CommitRecord, attempt_key, run_record_key
from ..protocol.selection import SaveRef, superseded_by
from ..retry import RetryPolicy
from .local import MAX_RUN_RECORD, LocalTier
from .parts import local_holdings
from .peer_frames import Frame, PeerCopyError, PeerLink, receive_part, send_part
from .tier_dir import PEERS, open_tier_dir, peer_folder

__all__ = ["MAX_PEER_FOLDERS", "RepairPlan", "durable_attempts", "peer_holdings", "plan_repair",
           "read_durable_records", "send_held_part", "write_back"]

#: peer folders of one rank looked at, at most, when it reports what it holds
MAX_PEER_FOLDERS = 8
_PEER_NAME = re.compile(r"rank-(0|[1-9][0-9]{0,8})")


def peer_holdings(local_tier: str | os.PathLike[str], run_id: str, holder: int, identity_digest: str,
                  auth: RecordAuth) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """What rank ``holder`` holds verified of other ranks' parts: sender ->
    the newest commits whose part for that sender verifies (as
    :func:`~ckptstore.tiers.parts.local_holdings`), from at most
    :data:`MAX_PEER_FOLDERS` folders ``rank-<holder>/.peers/rank-<s>``; and the
    reasons for what was not usable. Never raises (a link, a foreign folder
    name, an unreadable folder: reported, not followed)."""
    out: dict[int, list[dict[str, Any]]] = {}
    reasons: list[str] = []
    try:
        backend = open_tier_dir(local_tier, holder, create=False)
    except CkptStoreError as exc:
        return out, [f"rank {holder}: peer copies: {exc}"[:300]]
    if backend is None:
        return out, reasons
    try:
        top = os.path.join(backend.root, PEERS)
        if not backend.ops.exists(top):
            return out, reasons
        fd = backend.ops.open_directory(top)
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
    except (CkptStoreError, OSError) as exc:
        backend.close()
        return out, [f"rank {holder}: peer copies unreadable: {exc}"[:300]]
    backend.close()
    looked = 0
    for name in names:
        m = _PEER_NAME.fullmatch(name)
        if m is None or int(m.group(1)) == holder:
            reasons.append(f"rank {holder}: {PEERS}/{name[:64]!r} is not a peer folder; ignored")
            continue
        if looked >= MAX_PEER_FOLDERS:
            reasons.append(f"rank {holder}: more than {MAX_PEER_FOLDERS} peer folders; the rest not looked at")
            break
        looked += 1
        sender = int(m.group(1))
        held, why = local_holdings(local_tier, run_id, sender, identity_digest, auth,
                                   folder=peer_folder(holder, sender))
        reasons += [f"peer copy held by rank {holder}: {w}"[:300] for w in why[:5]]
        if held:
            out[sender] = held
    return out, reasons[:20]


def _live(k: tuple[int, int, str, str], attempts: Mapping[int, AttemptRecord] | None) -> bool:
    return attempts is None or superseded_by(k[0], k[1], attempts) is None


def durable_attempts(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None, run_id: str,
                     auth: RecordAuth, retry: RetryPolicy | None) -> dict[int, AttemptRecord]:
    """The durable tier's effective attempt records (what :func:`plan_repair` judges zombies by);
    the durable tier's errors raise (the caller plans nothing then: fail closed)."""
    backend = backend_from_url(url, storage_options=storage_options)
    try:
        return dict(AttemptLog(RunIO(backend, run_id, retry), auth).load().effective)
    finally:
        backend.close()


def _key(h: Mapping[str, Any]) -> tuple[int, int, str, str] | None:
    step, attempt, sid, digest = h.get("step"), h.get("attempt"), h.get("save_id"), h.get("manifest_digest")
    if isinstance(step, int) and isinstance(attempt, int) and isinstance(sid, str) and isinstance(digest, str):
        return step, attempt, sid, digest
    return None


@dataclass(frozen=True)
class RepairPlan:
    """The save every rank's part is held of somewhere, and who sends which part."""

    #: (step, attempt, save ID, manifest digest) of the save
    target: tuple[int, int, str, str]
    #: rank lacking its part -> the rank that holds a peer copy of it
    fetch: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        step, attempt, sid, digest = self.target
        return {"step": step, "attempt": attempt, "save_id": sid, "manifest_digest": digest,
                "fetch": {str(r): h for r, h in sorted(self.fetch.items())}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RepairPlan:
        key = _key(d)
        fetch = d.get("fetch")
        if key is None or not isinstance(fetch, Mapping):
            raise PeerCopyError("the coordinator's repair plan is malformed")
        return cls(key, {int(r): int(h) for r, h in fetch.items()})


def plan_repair(own: Mapping[int, Sequence[Mapping[str, Any]]],
                peers: Mapping[int, Mapping[int, Sequence[Mapping[str, Any]]]], world_size: int,
                attempts: Mapping[int, AttemptRecord] | None = None,
                ) -> tuple[RepairPlan | None, int | None, int | None]:
    """The newest save of which every rank's part is held verified somewhere
    (``own``: rank -> what its own folder holds; ``peers``: holder -> sender ->
    what its peer folder of that sender holds), with a holder for each rank
    that lacks it in its own folder (the lowest-numbered holder); None when
    no save is held whole or no rank lacks its part. Also: the newest step of
    which every part is held somewhere (what a resume from the local tiers
    could reach), and the newest step any rank holds any part of (the newest
    save the job is known to have made: what ``steps_lost_with_local_tier``
    counts from), each None when there is none. ``attempts``: the durable
    tier's effective attempt records; a save a later attempt superseded there
    (a zombie's) is neither planned nor counted."""
    have: dict[int, dict[tuple[int, int, str, str], int | None]] = {r: {} for r in range(world_size)}
    for r, held in own.items():
        for h in held:
            k = _key(h)
            if k is not None and r in have and _live(k, attempts):
                have[r][k] = None
    for holder, senders in sorted(peers.items()):
        for s, held in senders.items():
            if s not in have or s == holder:
                continue
            for h in held:
                k = _key(h)
                if k is not None and k not in have[s] and _live(k, attempts):
                    have[s][k] = holder
    candidates: set[tuple[int, int, str, str]] = set()
    for v in have.values():
        candidates |= set(v)
    anywhere = max((k[0] for k in candidates), default=None)
    for k in sorted(candidates, reverse=True):
        if all(k in have[r] for r in have):
            fetch = {r: who for r in have if (who := have[r][k]) is not None}
            return (RepairPlan(k, fetch) if fetch else None), k[0], anywhere
    return None, None, anywhere


def read_durable_records(durable: RunIO, attempt: int) -> tuple[bytes, bytes]:
    """The durable run record and attempt record ``attempt`` (bytes, bounded): what
    a write-back mirrors into the owner's folder before it holds a part there."""
    return (durable.get_bounded(run_record_key(durable.run_id), MAX_RUN_RECORD),
            durable.get_bounded(attempt_key(durable.run_id, attempt), MAX_RUN_RECORD))


def send_held_part(link: PeerLink, dst: int, local_tier: str | os.PathLike[str], holder: int, owner: int,
                   run_id: str, step: int, attempt: int, identity_digest: str, auth: RecordAuth) -> list[str]:
    """Rank ``holder`` sends rank ``owner`` its part of the save ``(step,
    attempt)`` from the peer folder it keeps of ``owner`` (a write-back at
    resume). A folder or record that cannot be read sends a "nothing" frame
    (the receiver then does not hold the save); a component that fails to
    read is sent as zeros (the receiver's digest refuses it). Returns what failed
    (a frame of pieces the owner refused included)."""
    try:
        backend = open_tier_dir(local_tier, owner, create=False, folder=peer_folder(holder, owner))
        if backend is None:
            raise PeerCopyError(f"rank {holder} holds no peer folder of rank {owner}")
    except CkptStoreError as exc:
        send_part(link, dst, step, None, lambda k, e: iter(()), [])
        return [str(exc)[:300]]
    try:
        io = RunIO(backend, run_id, None)
        read_run_record(io, None)  # the folder's copy of the run record: the layout of its names
        rec = Catalog(io, AttemptLog(io, auth), identity_digest).load_commit(step, attempt)
        data = rec.encode()
    except (CkptStoreError, OSError) as exc:
        backend.close()
        send_part(link, dst, step, None, lambda k, e: iter(()), [])
        return [f"{type(exc).__name__}: {exc}"[:300]]
    try:
        mine = part_names(rec, owner)
        names = sorted(mine if mine is not None else rec.components)
        sent = send_part(link, dst, step, data, lambda k, e: io.verified_chunks(
            k, e, f"rank {holder}'s peer copy of {k.rsplit('/', 1)[-1]!r}"), names)
        return sent.failed + ([f"rank {owner} refused the write-back"] if sent.refused else [])
    finally:
        backend.close()


def write_back(frame: Frame, local_tier: str | os.PathLike[str], rank: int, url: str | os.PathLike[str],
               storage_options: Mapping[str, Any] | None, auth: RecordAuth, identity_digest: str,
               retry: RetryPolicy | None) -> SaveRef:
    """Rank ``rank`` writes its own part, received from a holder of its peer
    copy, back into its own folder (``<local_tier>/rank-<r>``): the durable
    run record and attempt records (of the durable store at ``url``) mirrored
    there first (never the holder's copies), then :func:`receive_part`. The
    frame is consumed whole, whatever fails."""
    try:
        backend = backend_from_url(url, storage_options=storage_options)
    except BaseException:
        frame.drain()
        raise
    try:
        return _write_back(frame, local_tier, rank, RunIO(backend, frame.record.run_id, retry), auth,
                           identity_digest, retry)
    finally:
        backend.close()


def _same_as_durable(durable: RunIO, attempts: AttemptLog, identity_digest: str, rec: CommitRecord) -> None:
    """A copy of a save the durable tier also holds must be that save's record (same manifest digest): a
    copy that differs is refused before anything of it is written (a missing durable commit is not a
    refusal: the save may never have been replicated; an unreadable one is, fail closed)."""
    try:
        durable_rec = Catalog(durable, attempts, identity_digest).load_commit(rec.step, rec.attempt)
    except NotFoundError:
        return
    if durable_rec.manifest_digest() != rec.manifest_digest():
        raise CorruptionError(f"the peer copy of step {rec.step} (attempt {rec.attempt}) differs from the durable "
                              "commit of the same step and attempt; it is not written back")


def _write_back(frame: Frame, local_tier: str | os.PathLike[str], rank: int, durable: RunIO, auth: RecordAuth,
                identity_digest: str, retry: RetryPolicy | None) -> SaveRef:
    try:
        attempts = AttemptLog(durable, auth)
        tier = LocalTier(local_tier, durable.run_id, attempts, identity_digest, auth, retry, part=rank,
                         durable_url=durable.backend.url)
    except BaseException:
        frame.drain()
        raise
    try:
        run_record, _ = read_durable_records(durable, frame.record.attempt)
        read_run_record(durable, None)
        _same_as_durable(durable, attempts, identity_digest, frame.record)
        tier.io.layout_or_none = durable.layout  # the durable run record decides the naming
        tier.mirror(run_record, attempts.load())
        return receive_part(frame, tier)
    except BaseException:
        frame.drain()
        raise
    finally:
        tier.backend.close()
