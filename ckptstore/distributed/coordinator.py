"""One run, many ranks: the job opens the run once and saves all ranks or none.

    import torch.distributed as dist
    from ckptstore.distributed import open_distributed

    dist.init_process_group("gloo")            # or nccl; messages go through the rendezvous store
    run = open_distributed(url, "run-7", identity=identity)   # every rank calls it
    if run.resumed_from is not None:
        my_bytes = run.store.read(run.resumed_from, f"rank{run.rank}/model")
    with run.save(step) as s:                  # every rank enters, with its own components
        s.put(f"rank{run.rank}/model", data)
    # leaving the block: every rank reports its inventory, the coordinator
    # publishes once, every rank returns the same SaveRef (s.ref) or raises the same error

Rank 0 of the group is the coordinator: it binds the identity, registers the
single attempt, chooses the resume point and creates the commit record. The
other ranks receive each outcome as canonical JSON (never pickle) through the
process group's rendezvous store; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, Self

import torch.distributed as dist

from .. import RecordAuth
from .. import protocol as P
from ..core.piece_deadlines import PieceDeadline, check_deadlines
from ..errors import (
    CkptStoreError,
    CommitUnknownError,
    CorruptionError,
    IdentityMismatchError,
    InvalidInputError,
    SaveAbortedError,
)
from ..identity import RunIdentity, identity_digest, normalize_identity
from ..options import AuthOptions, OpenOptions, options_from_keywords
from ..protocol.auth import AuthPolicy, Keyring
from ..protocol.records import PieceRef, pieces_digest
from ..protocol.selection import SaveRef
from ..store import CheckpointStore
from .agreement import FlagAgreement, PeerLostError
from .channel import Channel, CoordinatorLostError, RanksFailedError
from .errors import WorldSizeMismatchError, error_from_json, error_to_json, may_delete_after, rank_error_json
from .peer_link import setup_peers

#: The points of a distributed save at which an :func:`at_phase` callback runs: on the coordinator,
#: and (``"member_before_part_commit"``) on a member of a job with a local tier.
PHASES = ("before_gather", "before_publish", "after_publish", "member_before_part_commit")
_AT_PHASE: dict[str, Callable[[], None]] = {}


def at_phase(phase: str, callback: Callable[[], None] | None) -> None:
    """Run ``callback`` on the coordinator each time a distributed save of this
    process reaches ``phase``: ``"before_gather"`` (its own components written,
    the ranks' inventories not yet gathered), ``"before_publish"`` (every
    inventory checked, the commit record not yet created) or ``"after_publish"``
    (the commit record created, the ranks not yet told); on a member of a job
    with a local tier, ``"member_before_part_commit"`` (the coordinator's record
    received and checked, this rank's part not yet committed in its local tier).
    None removes it.

    The seam for fault-injection tests and drills (a SIGKILL at that point);
    ckptstore installs no callback itself. An unknown phase is an
    :class:`~ckptstore.errors.InvalidInputError`."""
    if phase not in PHASES:
        raise InvalidInputError(f"at_phase: unknown phase {phase!r}; the phases are {', '.join(PHASES)}")
    if callback is None:
        _AT_PHASE.pop(phase, None)
    else:
        _AT_PHASE[phase] = callback


def _reached(phase: str) -> None:
    fn = _AT_PHASE.get(phase)
    if fn is not None:
        fn()



def _ref_from_json(store: CheckpointStore, d: Mapping[str, Any]) -> SaveRef:
    ref = store.get_save(int(d["step"]), int(d["attempt"]))
    if ref.manifest_digest != d["manifest_digest"] or ref.save_id != d["save_id"]:
        raise CorruptionError(
            f"run {store.run_id!r}: the commit of step {d['step']} read here differs from the coordinator's "
            f"({ref.manifest_digest[:12]} vs {str(d['manifest_digest'])[:12]})"
        )
    return ref


def entry_to_json(c: P.ComponentEntry) -> list[Any]:
    """A component of a rank's inventory as a message: [size, blake3] and, for a
    pieced component (PROTOCOL.md §9), its pieces."""
    return [c.size, c.blake3] + ([[p.to_json() for p in c.pieces]] if c.pieces is not None else [])


def entry_from_json(name: str, entry: Any) -> P.ComponentEntry:
    """The inverse of :func:`entry_to_json`; a piece list that does not add up is refused."""
    size, digest = int(entry[0]), str(entry[1])
    if len(entry) < 3:
        return P.ComponentEntry(name, size, digest)
    pieces = tuple(PieceRef(str(h), str(d), int(n)) for h, d, n in entry[2])
    if sum(p.size for p in pieces) != size or pieces_digest(pieces) != digest or any(
        P.parse_save_id(p.holder) is None for p in pieces
    ):
        raise SaveAbortedError(f"component {name!r}: its piece list does not add up; nothing was published")
    return P.ComponentEntry(name, size, digest, pieces)


class DistributedRun:
    """The job-wide handle every rank gets from :func:`open_distributed`."""

    def __init__(
        self, store: CheckpointStore, channel: Channel, *, resharded: dict[str, Any] | None, save_timeout: float
    ) -> None:
        self.store = store
        self.channel = channel
        self.rank = channel.rank
        self.world_size = channel.world_size
        self.save_timeout = save_timeout
        #: ``{"from_world_size": N, "to_world_size": M, ...}`` when this attempt resharded on resume.
        self.resharded = resharded
        self._agreement: FlagAgreement | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.channel.is_coordinator

    @property
    def attempt(self) -> P.AttemptRecord:
        assert self.store.attempt is not None
        return self.store.attempt

    @property
    def resumed_from(self) -> SaveRef | None:
        return self.store.resumed_from

    def save(
        self, step: int, *, metadata: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> DistributedSave:
        """Begin a save of ``step`` on every rank (collective: every rank calls it)."""
        return DistributedSave(self, step, dict(metadata or {}), self.save_timeout if timeout is None else timeout)

    def agree_preemption(self, flag: bool) -> bool:
        """Collective at every step end (:mod:`.agreement`); ``PeerLostError`` abandons this rank's waits."""
        if self._agreement is None:
            self._agreement = FlagAgreement(self.channel.group)
        try:
            return self._agreement.agree(flag)
        except PeerLostError:
            self.channel.abandon()
            raise

    def close(self) -> None:
        self.channel.close()
        self.store.close()


class DistributedSave:
    """One all-ranks-or-none save. Use as a context manager on every rank."""

    def __init__(self, run: DistributedRun, step: int, metadata: dict[str, Any], timeout: float) -> None:
        P.validate_step(step)
        try:
            P.canonical_json(metadata)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"save metadata must be JSON-representable: {exc}") from None
        self.run = run
        self.step = step
        self.metadata = metadata
        self.timeout = timeout
        self.ref: SaveRef | None = None
        ch = run.channel
        self._tag = ch.next()
        if ch.is_coordinator:
            try:
                sid = run.store.new_save_id(step)
                msg: dict[str, Any] = {"ok": True, "save_id": sid}
            except Exception as exc:
                ch.post(self._tag, "sid", {"ok": False, "error": error_to_json(exc)})
                raise
            ch.post(self._tag, "sid", msg)
        else:
            try:
                msg = ch.receive(self._tag, "sid")
            except CoordinatorLostError as exc:
                raise SaveAbortedError(f"save of step {step}: the coordinator (rank 0) did not start it ({exc})") from exc
            if not msg.get("ok"):
                raise error_from_json(msg["error"])
        self.save_id: str = str(msg["save_id"])
        self._staged = run.store.stage(step, save_id=self.save_id)

    def put(self, name: str, data: Any) -> P.ComponentEntry:
        """Write one of this rank's components (hashed while written). Names
        must be unique across ranks (e.g. prefix them with the rank)."""
        return self._staged.put(name, data)

    def put_many(self, items: Sequence[tuple[str, Any]]) -> dict[str, P.ComponentEntry]:
        """Write several of this rank's components, made durable together (``StagedSave.put_many``)."""
        return self._staged.put_many(items)

    @property
    def components(self) -> dict[str, P.ComponentEntry]:
        return self._staged.components

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            try:
                report: dict[str, Any] = self._inventory()
            except SaveAbortedError as failed:  # this rank's part cannot be published (§9.4): tell the others
                self._staged.abort()
                report = {"ok": False, "error": f"{type(failed).__name__}: {failed}"}
        else:
            self._staged.abort()
            report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if exc is not None and not isinstance(exc, Exception):
            # KeyboardInterrupt, SystemExit: tell the others, then let it propagate unchanged
            with contextlib.suppress(CkptStoreError):
                self._finish(report)
            return
        self.ref = self._finish(report)

    def _inventory(self) -> dict[str, Any]:
        """This rank's report: its components and, when it wrote pieces
        (version 3), the deadlines of its part, after its own intent checks
        (§9.4 steps 1-2: waits for its intent's window when needed)."""
        comps = self._staged.components
        report: dict[str, Any] = {"ok": True, "components": {n: entry_to_json(c) for n, c in sorted(comps.items())}}
        pieces = self._staged.pieces
        if pieces is not None:
            report["pieces"] = pieces.check_relied(claim=True).to_json()
        return report

    # ----------------------------------------------------------------- finish
    def _finish(self, report: dict[str, Any]) -> SaveRef:
        ch = self.run.channel
        ch.post(self._tag, "inventory", report)
        if ch.is_coordinator:
            return self._coordinate()
        return self._follow()

    def _coordinate(self) -> SaveRef:
        ch, store = self.run.channel, self.run.store
        err: BaseException | None = None
        ref: SaveRef | None = None
        alive = list(range(1, ch.world_size))
        try:
            _reached("before_gather")
            try:
                invs = ch.gather(self._tag, "inventory", timeout=self.timeout)
            except RanksFailedError as exc:
                alive = [r for r in alive if r not in exc.ranks]
                raise SaveAbortedError(
                    f"save of step {self.step}: {exc}; nothing was published, the previous save stays selected"
                ) from exc
            failed = {r: str(i.get("error")) for r, i in sorted(invs.items()) if not i.get("ok")}
            if failed:
                shown = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
                raise SaveAbortedError(
                    f"save of step {self.step}: rank(s) {', '.join(map(str, failed))} failed ({shown}); "
                    "nothing was published, the previous save stays selected"
                )
            comps: dict[str, P.ComponentEntry] = {}
            owner: dict[str, int] = {}
            ranks: dict[int, list[str]] = {}
            for r, inv in sorted(invs.items()):
                names = []
                for n, entry in dict(inv["components"]).items():
                    if n in owner:
                        raise SaveAbortedError(
                            f"save of step {self.step}: component {n!r} was written by rank {owner[n]} and rank {r}; "
                            "component names must be unique across ranks (prefix them with the rank)"
                        )
                    owner[n] = r
                    comps[n] = entry_from_json(n, entry)
                    names.append(n)
                ranks[r] = sorted(names)
            deadlines = {r: PieceDeadline.from_json(inv["pieces"]) for r, inv in invs.items() if "pieces" in inv}
            check_deadlines(deadlines, store.piece_timing, self.save_id)  # each rank's intent still protects its part
            _reached("before_publish")
            ref = store.publish(
                self.step, self.save_id, comps, metadata=self.metadata, ranks=ranks, world_size=ch.world_size,
                rank_pieces=deadlines,
            )
            _reached("after_publish")
            outcome: dict[str, Any] = {"ok": True, "ref": ref.to_json()}
            if store.tiered:  # every rank publishes the same record bytes in its own local tier
                outcome["record"] = ref.record.encode().decode("utf-8")
        except Exception as exc:  # noqa: BLE001 - every failure is reported to every rank
            err = exc
            outcome = {"ok": False, "error": error_to_json(exc)}
        ch.post(self._tag, "outcome", outcome)
        if err is not None and may_delete_after(err):
            self._staged.abort()
        if err is None and "record" in outcome:
            assert ref is not None
            return self._decide(ref)
        # Keep the rendezvous store (hosted here) up until the members read the outcome.
        self._linger("ack", alive)
        if err is not None:
            raise err
        assert ref is not None
        return ref

    def _linger(self, what: str, ranks: list[int]) -> None:
        """The coordinator: wait (bounded, failures ignored) until ``ranks`` said
        ``what``, so the rendezvous store it hosts stays up until they read its last message."""
        ch = self.run.channel
        try:
            ch.gather(self._tag, what, ranks=ranks, timeout=min(ch.timeout, 60.0))
        except (RanksFailedError, CoordinatorLostError):
            pass

    def _decide(self, ref: SaveRef) -> SaveRef:
        """The coordinator of a job with a local tier, its record committed in its
        own local tier: gather every member's ack (its part committed in its local
        tier, or why not) within the channel timeout, then tell every rank the
        decision. The save is acknowledged (``ref`` returned here, the same ref on
        every rank) only when every rank's part is committed; otherwise every rank
        raises the same :class:`CommitUnknownError` naming the ranks. Nothing is
        deleted either way (the local commits stay, gc_local removes them later)."""
        ch = self.run.channel
        members = list(range(1, ch.world_size))
        try:
            acks = ch.gather(self._tag, "ack", ranks=members, timeout=ch.timeout)
            failed = {r: str(a.get("error")) for r, a in sorted(acks.items()) if a.get("part") is not True}
            silent: list[int] = []
        except (RanksFailedError, CoordinatorLostError) as exc:
            silent = list(getattr(exc, "ranks", members))
            failed = {r: f"no ack ({exc})" for r in silent}
        err = self._unacknowledged(failed, silent) if failed else None
        ch.post(self._tag, "decision", {"ok": True} if err is None else {"ok": False, "error": error_to_json(err)})
        self._linger("seen", [r for r in members if r not in silent])
        if err is not None:
            raise err
        self.run.store.acknowledged(ref)  # peer copies of this rank's part start now, in the background
        return ref

    def _unacknowledged(self, failed: Mapping[int, str], silent: list[int]) -> CommitUnknownError:
        """The error every rank raises when some rank's part was not committed
        (``failed``: rank -> why; ``silent``: those that sent no ack at all)."""
        named = ", ".join(map(str, failed))
        shown = "; ".join(f"rank {r}: {m}" for r, m in failed.items())[:2000]
        if silent:
            after = ("its part may or may not be committed in its local tier, and the save is resumed from the "
                     "local tiers only if every rank holds its part verified")
        else:
            after = "it will not be resumed from the local tiers (the resume needs every rank's part)"
        return CommitUnknownError(
            f"save of step {self.step} ({self.save_id}): rank(s) {named} did not commit their part in their local "
            f"tier ({shown}); the save is not acknowledged: {after}. Nothing was deleted; the previous "
            "acknowledged save stays the one every rank holds, and latest_complete() tells what landed."
        )

    def _follow(self) -> SaveRef:
        ch, store = self.run.channel, self.run.store
        try:
            outcome = ch.receive(self._tag, "outcome", timeout=self.timeout + ch.timeout)
        except CoordinatorLostError as exc:
            # The coordinator may or may not have created the commit record: delete nothing.
            raise CommitUnknownError(
                f"save of step {self.step} ({self.save_id}): rank 0 (the coordinator) did not send the outcome ({exc}); "
                "the commit may or may not exist. Nothing was deleted; latest_complete() tells what landed."
            ) from exc
        if outcome.get("ok") and store.tiered and isinstance(outcome.get("record"), str):
            ref, why = self._commit_part(store, str(outcome["record"]).encode("utf-8"), outcome["ref"])
            return self._await_decision(ref, {"part": True} if why is None else {"part": False, "error": why})
        try:
            ch.post(self._tag, "ack", {})
        except CoordinatorLostError:
            pass
        if not outcome.get("ok"):
            err = error_from_json(outcome["error"])
            if may_delete_after(err):
                self._staged.abort()
            raise err
        ref = _ref_from_json(store, outcome["ref"])
        store.learn_published(ref)  # the next save of this rank skips the pieces of this one
        return ref

    def _commit_part(self, store: CheckpointStore, data: bytes, want: Mapping[str, Any]) -> tuple[SaveRef | None, str | None]:
        """A member of a tiered job: the coordinator's record checked against its
        reference and this rank's components, then this rank's part committed in
        its local tier. Returns the local ref, or None and why it was not committed
        (never raises: the member still acks, and every rank follows one decision)."""
        try:
            rec = P.CommitRecord.decode(data, "the coordinator's commit record", run_id=store.run_id)
            self._check_record(SaveRef.of(rec), want)
            _reached("member_before_part_commit")
            return store.publish_record(data), None
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which decides for every rank
            return None, f"{type(exc).__name__}: {exc}"[:1000]

    def _check_record(self, ref: SaveRef, want: Mapping[str, Any]) -> None:
        """The coordinator's record is the save of its reference and of this
        rank's save ID, and lists this rank's components as written."""
        if ref.manifest_digest != want.get("manifest_digest") or ref.save_id != want.get("save_id") \
                or ref.save_id != self.save_id:
            raise CorruptionError(f"save of step {self.step}: the coordinator's record differs from its reference")
        wrote = self._staged.components
        if any(ref.components.get(n) != c for n, c in wrote.items()):
            raise CorruptionError(f"save of step {self.step}: the coordinator's record does not list this rank's "
                                  "components as written")

    def _await_decision(self, ref: SaveRef | None, ack: dict[str, Any]) -> SaveRef:
        """A member of a tiered job, its part committed (``ref``) or not: post
        its ack, wait for the coordinator's decision, return the save only when
        it was acknowledged, else raise the coordinator's error. Deletes nothing."""
        ch = self.run.channel
        with contextlib.suppress(CoordinatorLostError):
            ch.post(self._tag, "ack", ack)
        try:
            decision = ch.receive(self._tag, "decision", timeout=2 * ch.timeout)
        except CoordinatorLostError as exc:
            raise CommitUnknownError(
                f"save of step {self.step} ({self.save_id}): rank 0 (the coordinator) did not send its decision "
                f"({exc}); the save is not acknowledged. Nothing was deleted; latest_complete() tells what landed."
            ) from exc
        with contextlib.suppress(CoordinatorLostError):
            ch.post(self._tag, "seen", {})
        if not decision.get("ok"):
            raise error_from_json(decision["error"])
        if ref is None:  # the coordinator acknowledged a save this rank reported as not committed
            raise CommitUnknownError(f"save of step {self.step} ({self.save_id}): acknowledged by rank 0, but rank "
                                     f"{self.run.rank}'s part is not committed ({ack.get('error')})")
        self.run.store.acknowledged(ref)  # peer copies of this rank's part start now, in the background
        return ref


def _identity_dict(identity: RunIdentity | Mapping[str, Any]) -> dict[str, Any]:
    return normalize_identity(identity)


def open_distributed(
    url: str | os.PathLike[str],
    run_id: str,
    *,
    identity: RunIdentity | Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
    options: OpenOptions | None = None,
    resume_from: int | None | Literal["latest"] = "latest",
    reshard: bool = False,
    timeout: float = 300.0,
    save_timeout: float = 1800.0,
    storage_options: Mapping[str, Any] | None = None,
    **deprecated: Any,
) -> DistributedRun:
    """Open ``run_id`` for writing from every rank of ``group`` (collective).

    The coordinator (group rank 0) binds the identity, registers the one
    attempt of this job and chooses the resume point; the other ranks join
    that attempt. Every rank gets the same outcome, or raises the same error.

    ``identity["world_size"]`` (when present) must equal the group size. A
    save written with another number of ranks is not resumed (every rank
    raises :class:`IdentityMismatchError`, or :class:`WorldSizeMismatchError`
    when the identity does not name a world size) unless ``reshard=True``: the
    run is then continued under its bound identity and a ``reshard`` event is
    recorded. Only a loader that reshards (the DCP reader) can use such a
    resume point.

    ``timeout``: deadline of each control message (seconds). ``save_timeout``:
    how long the coordinator waits for every rank's inventory of a save (and
    how much longer than ``timeout`` the other ranks wait for the outcome of
    the open, which includes the deep check of the resume point).

    ``options``: one :class:`~ckptstore.options.OpenOptions` for every rank's
    store, with the meanings documented there (the flat keywords of earlier
    releases still work for this release, with a :class:`DeprecationWarning`).
    On many ranks:

    * Two tiers (``OpenOptions(tiers=TierOptions("/nvme/ckpt"))``, ``docs/tiers.md`` "Many
      ranks"): ``url`` is the durable tier; rank ``r`` keeps its local tier in
      ``<path>/rank-<r>`` on its own node's disk, holding its own part of every save under
      the same commit record bytes as the durable commit. A save is acknowledged (``save()``
      returns the same SaveRef on every rank) only once every rank committed its part in its
      local tier; otherwise every rank raises the same :class:`CommitUnknownError` naming the
      ranks whose part is not committed (PROTOCOL.md §"Tiers" 7). Each rank's background thread
      uploads its own components; the coordinator's creates the durable commit once every
      rank's part is listed there. The job resumes from the local tiers only when every
      rank holds its part of the chosen save verified (all ranks or none, ``resume-tier``
      event with every rank's reasons); otherwise every rank reads the durable copy.
    * Version 3 (pieces): each rank writes its own pieces, skips those of the newest
      commit it knows, and checks its own save intent before it reports its inventory; the
      coordinator re-checks every rank's deadlines and that every piece is present before
      it publishes (PROTOCOL.md §9.4); with local tiers each rank checks its own part's
      pieces in its own tier before committing its part, and replicates only the pieces of
      its part the durable tier lacks (§9.6). ``protocol_version=3`` creates a version-3 run with
      the job's one attempt; an existing run keeps its own version.
    * Authenticated records: keys come from ``options.auth.keyring`` or, when it is None,
      ``CKPTSTORE_AUTH_KEYS`` in each rank's environment (the same on every rank). Under
      ``"require"`` every record any rank writes carries a tag and every record any rank
      reads is verified. Every rank must pass the same policy, the same key IDs (the same
      active one) and the same ``protocol_version``: the hello exchange compares them (the
      keys themselves never leave a rank) and a mismatch, or a rank that cannot use its
      choice (``"require"`` without a key), is refused on every rank with an
      :class:`InvalidInputError` that names the rank and the fix.

    Every rank must make the same collective calls (open, each ``save``) in
    the same order, from one thread at a time.
    """
    ch = Channel(group, timeout=timeout, name=P.validate_run_id(run_id))
    try:
        o = options_from_keywords(options, deprecated, "open_distributed")
        auth, hello = _rank_choices(ch.rank, o.auth.policy, o.auth.keyring, o.protocol_version)
        # the keys resolved once, here: every store of this rank uses them
        o = replace(o, auth=AuthOptions(auth.policy, auth.keyring))
        args = _OpenArgs(url, run_id, _identity_dict(identity), timeout, save_timeout, storage_options, resume_from,
                         reshard, o)
        hello["identity_digest"] = identity_digest(args.identity)
        if o.tiers is not None and ch.world_size > 1:
            # every rank names its node; parts another node holds are written back where they are missing
            setup = setup_peers(ch, o.tiers, args.run_id, url, storage_options, identity_digest(args.identity),
                                auth, o.retry)
            args = replace(args, options=replace(o, tiers=replace(o.tiers, peer_job=setup)))
            if not ch.is_coordinator and "error" not in hello:
                # what this rank holds verified in its own local tier, for the coordinator's resume decision
                hello["local"] = {"held": setup.held, "reasons": setup.reasons[:20]}
        tag = ch.next()  # after the peers' exchanges: a tag retires the keys of the one two before it
        ch.post(tag, "hello", hello)
        if ch.is_coordinator:
            return _open_as_coordinator(ch, tag, args)
        return _open_as_member(ch, tag, args)
    except BaseException:
        ch.close()  # stop its heartbeat
        raise


@dataclass(frozen=True)
class _OpenArgs:
    """:func:`open_distributed`'s arguments, as both roles' steps read them."""

    url: str | os.PathLike[str]
    run_id: str
    identity: dict[str, Any]
    timeout: float
    save_timeout: float
    storage_options: Mapping[str, Any] | None
    resume_from: int | None | Literal["latest"]
    reshard: bool
    #: every rank's store options (the keys resolved)
    options: OpenOptions

    @property
    def tiered(self) -> bool:
        return self.options.tiers is not None

    def rank_options(self, rank: int, peers: Mapping[int, Mapping[str, Any]] | None) -> OpenOptions:
        """The store options of rank ``rank`` (tiered: its rank and, on the coordinator, what the others hold)."""
        o = self.options
        return o if o.tiers is None else replace(o, tiers=replace(o.tiers, rank=rank, peers=peers))


#: the choices every rank of a job must make alike, as the hello names them
_CHOICES = ("auth_policy", "signing_key", "key_ids", "protocol_version")


def _rank_choices(
    rank: int, policy: AuthPolicy | str, keyring: Keyring | None, protocol_version: int | None
) -> tuple[RecordAuth, dict[str, Any]]:
    """This rank's authentication (its keys from ``keyring`` or its environment)
    and the hello that tells the coordinator its choices: the policy, the key
    IDs (never a key) and the protocol version. A choice this rank cannot use
    is not raised here but carried in the hello (``"error"``), so the
    coordinator refuses it on every rank instead of leaving the others waiting."""
    try:
        auth = RecordAuth(policy, keyring)
    except CkptStoreError as exc:
        return RecordAuth("off", None), {"error": rank_error_json(rank, exc), "choices": None}
    ring = auth.keyring if auth.policy is not AuthPolicy.OFF else None
    choices = {"auth_policy": auth.policy.value, "signing_key": ring.active if ring is not None else None,
               "key_ids": ring.key_ids if ring is not None else [], "protocol_version": protocol_version}
    return auth, {"choices": choices}


def _check_hellos(run_id: str, rank: int, hellos: Mapping[int, Mapping[str, Any]], a: _OpenArgs) -> None:
    """The coordinator (``rank``): every rank said hello with the same identity and
    the same choices (:data:`_CHOICES`) as its own, else one error for every rank."""
    for _, h in sorted(hellos.items(), key=lambda kv: (kv[0] != rank, kv[0])):  # its own problem first
        if isinstance(h.get("error"), dict):
            raise error_from_json(dict(h["error"]))
    mine = hellos[rank]
    hellos = {r: h for r, h in hellos.items() if r != rank}
    digest = identity_digest(a.identity)
    other = sorted(r for r, h in hellos.items() if h.get("identity_digest") != digest)
    if other:
        raise InvalidInputError(
            f"run {run_id!r}: rank(s) {', '.join(map(str, other))} opened it with another identity than rank {rank}"
        )
    ours = dict(mine.get("choices") or {})
    differ = []
    for r, h in sorted(hellos.items()):
        theirs = dict(h.get("choices") or {})
        for k in _CHOICES:
            if theirs.get(k) != ours.get(k):
                differ.append(f"rank {r} has {k}={theirs.get(k)!r}, rank {rank} {ours.get(k)!r}")
    if differ:
        raise InvalidInputError(
            f"run {run_id!r}: the ranks opened it with different choices ({'; '.join(differ[:8])}); every rank "
            "must pass open_distributed the same auth_policy, protocol_version and keys (keyring=..., or the same "
            "CKPTSTORE_AUTH_KEYS in every rank's environment). Nothing was opened"
        )


def _open_as_coordinator(ch: Channel, tag: str, a: _OpenArgs) -> DistributedRun:
    """Rank 0: check every rank's identity, open the run (bind, register the
    attempt, choose the resume point), tell the ranks, wait until each joined."""
    store: CheckpointStore | None = None
    resharded: dict[str, Any] | None = None
    err: BaseException | None = None
    try:
        # tiered: each rank re-hashes its newest local parts before it says hello (bounded like a save)
        hellos = ch.gather(tag, "hello", timeout=a.timeout + a.save_timeout if a.tiered else None)
        _check_hellos(a.run_id, ch.rank, hellos, a)
        peers = {r: dict(h.get("local") or {}) for r, h in sorted(hellos.items()) if r != ch.rank}
        store, resharded = _coordinator_open(
            a.url, a.run_id, a.identity, ch.world_size, resume_from=a.resume_from, reshard=a.reshard,
            options=replace(a.rank_options(0, peers), single_writer=True),  # the job's one coordinator
            storage_options=a.storage_options,
        )
        assert store.attempt is not None
        outcome: dict[str, Any] = {
            "ok": True, "attempt": store.attempt.number, "identity": store.identity,
            "resumed_from": (store.resumed_from.to_json() if store.resumed_from else None), "resharded": resharded,
        }
    except Exception as exc:  # noqa: BLE001
        err = exc
        outcome = {"ok": False, "error": error_to_json(exc)}
    ch.post(tag, "outcome", outcome)
    if err is not None:
        raise err
    assert store is not None
    try:
        joined = ch.gather(tag, "joined", ranks=range(1, ch.world_size))
        bad = {r: j["error"] for r, j in sorted(joined.items()) if not j.get("ok")}
        if bad:
            raise error_from_json(next(iter(bad.values())))
        ready: dict[str, Any] = {"ok": True}
    except Exception as exc:
        ready = {"ok": False, "error": error_to_json(exc)}
        ch.post(tag, "ready", ready)
        store.close()
        raise
    ch.post(tag, "ready", ready)
    return DistributedRun(store, ch, resharded=resharded, save_timeout=a.save_timeout)


def _open_as_member(ch: Channel, tag: str, a: _OpenArgs) -> DistributedRun:
    """Any other rank: wait for the coordinator's outcome, join its attempt,
    report, and wait until every rank joined."""
    # Members wait longer than the coordinator's own deadlines, so a coordinator
    # that gives up on a rank still reaches everyone else with its answer; the
    # coordinator's open includes the deep check of the resume point (every
    # byte re-hashed), which is bounded by save_timeout like a save.
    outcome = ch.receive(tag, "outcome", timeout=2 * a.timeout + a.save_timeout)
    if not outcome.get("ok"):
        raise error_from_json(outcome["error"])
    member: CheckpointStore | None = None
    try:
        member = CheckpointStore.open(
            a.url, a.run_id, identity=outcome["identity"], join_attempt=int(outcome["attempt"]),
            options=a.rank_options(ch.rank, None), storage_options=a.storage_options,
        )
        if outcome["resumed_from"] is not None and member.resumed_from is None:
            # the coordinator's tier decision holds on every rank (all ranks local, or all durable)
            tier = str(outcome["resumed_from"].get("tier", "durable")) if member.tiered else "durable"
            point = replace(_ref_from_json(member, outcome["resumed_from"]), tier=tier)
            member.adopt_resume_point(point)
            member.learn_published(point)  # its first save skips the pieces of the resume point
        ch.post(tag, "joined", {"ok": True})
    except Exception as exc:
        ch.post(tag, "joined", {"ok": False, "error": error_to_json(CkptStoreError(f"rank {ch.rank}: {exc}"))})
        if member is not None:
            member.close()
        raise
    ready = ch.receive(tag, "ready", timeout=2 * a.timeout)
    if not ready.get("ok"):
        member.close()
        raise error_from_json(ready["error"])
    return DistributedRun(member, ch, resharded=outcome.get("resharded"), save_timeout=a.save_timeout)


def _coordinator_open(
    url: str | os.PathLike[str],
    run_id: str,
    ident: dict[str, Any],
    world_size: int,
    *,
    resume_from: int | None | Literal["latest"],
    reshard: bool,
    options: OpenOptions,
    storage_options: Mapping[str, Any] | None,
) -> tuple[CheckpointStore, dict[str, Any] | None]:
    """The coordinator's store: the run bound (or created, at ``options.protocol_version``)
    and the job's one attempt registered."""
    want = ident.get("world_size")
    if want is not None and want != world_size:
        raise WorldSizeMismatchError(
            f"run {run_id!r}: the identity says world_size={want!r}, but the process group has {world_size} ranks"
        )

    def _open(identity: dict[str, Any]) -> CheckpointStore:
        return CheckpointStore.open(url, run_id, identity=identity, resume_from=resume_from, options=options,
                                    storage_options=storage_options)

    resharded: dict[str, Any] | None = None
    try:
        store = _open(ident)
    except IdentityMismatchError as exc:
        if not (reshard and exc.fields == ["world_size"]):
            raise
        stored_ws = exc.details["world_size"][0]
        store = _open({**ident, "world_size": stored_ws})
        resharded = {"from_world_size": stored_ws, "to_world_size": world_size}
    ref = store.resumed_from
    saved_ws = ref.record.world_size if ref is not None else None
    if saved_ws is not None and saved_ws != world_size:
        if not reshard:
            store.close()
            raise WorldSizeMismatchError(
                f"run {run_id!r}: the save being resumed (step {ref.step if ref else '?'}) was written by "
                f"{saved_ws} ranks, this job has {world_size}; pass reshard=True and load it with the DCP reader "
                "(ckptstore.distributed.dcp.writer), which reshards (the per-rank Checkpointer path, RankStore, cannot), "
                f"or resume with {saved_ws} ranks"
            )
        resharded = {"from_world_size": saved_ws, "to_world_size": world_size}
    if resharded is not None:
        resharded["resumed_from"] = ref.step if ref is not None else None
        store.record_event("reshard", resharded)
    return store, resharded
