"""A Hypothesis state machine over two tiers on two ranks (two nodes) with
peer copies, in one process: a coordinator store and a member store on one
durable directory (as tests/tiers/test_parts.py wires them), each rank's
``PeerCopies`` thread joined to the other's by an in-memory link, real local
tier folders. Rules: saves (acknowledged on both ranks: the real background
copies run), a bit flip / truncation / removal of a rank's own part or of a
peer copy, a node lost with its disk, restarts (the open's write-back from the
peer copies, then the all-ranks-or-none decision).

Invariants: after every restart, the resume point is the newest save every
rank's part of which survived intact somewhere (its own folder or the other
node's copy) when that is newer than the newest durable save, else the durable
one; every rank reads its part of it back bit for bit; and a damaged copy is
never the source of a byte read."""

from __future__ import annotations

import shutil
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ckptstore import CheckpointStore, OpenOptions, PieceTiming, RecordAuth, TierOptions
from ckptstore.errors import CkptStoreError
from ckptstore.identity import identity_digest
from ckptstore.tiers import (
    durable_attempts,
    local_holdings,
    peer_holdings,
    plan_repair,
    receive_frame,
    send_held_part,
    write_back,
)
from tests.peer_wire import End, Wire

IDENT = {"model": "tiny", "world_size": 2}
KEEP = 3


@dataclass
class Job:
    """What ``open_distributed``'s peer step leaves on each rank (``TierOptions.peer_job``)."""

    link: End
    receivers: dict[int, tuple[int, ...]] = field(default_factory=lambda: {0: (1,), 1: (0,)})
    off: str | None = None
    sources: dict[int, Any] = field(default_factory=dict)
    newest_everywhere: int | None = None
    newest_anywhere: int | None = None


def _event(what: str) -> None:
    """What a random run reached (``--hypothesis-show-statistics``); nothing in a fixed run."""
    try:
        event(what)
    except InvalidArgument:
        pass


#: version 3: each rank's frozen part (at least 1 MiB: a piece of its own, reused by every save)
FROZEN = {r: bytes((r * 7 + i * 13) % 251 for i in range(1_100_000)) for r in (0, 1)}


def part(step: int, rank: int) -> bytes:
    return bytes((step * 13 + rank * 5 + i) % 251 for i in range(3000 + 1000 * rank))


def damage(f: Path, how: str) -> None:
    if how == "flip":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x10
        f.write_bytes(bytes(b))
    elif how == "truncate":
        f.write_bytes(f.read_bytes()[:-5])
    else:
        f.unlink()


class PeerTiers(RuleBasedStateMachine):
    #: the run's protocol version (3: each part also holds ``rank<r>/frozen``, the same bytes at every step,
    #: one piece every save reuses; its copies travel once)
    version = 2

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[str, Any] = {}
        self.dir = Path(tempfile.mkdtemp(prefix="peer-sm-"))
        self.url = str(self.dir / "durable")
        self.local = self.dir / "local"
        self.auth = RecordAuth("off", None)
        self.digest = identity_digest(IDENT)
        #: save ID -> step, of every acknowledged save; and which copies of it are intact
        self.steps: dict[str, int] = {}
        self.intact: dict[tuple[str, str, int], bool] = {}  # (save ID, "own"|"peer", rank) -> intact
        self.durable_step: int | None = None
        self.stores: tuple[CheckpointStore, CheckpointStore] | None = None
        self.expected_resume: int | None = None
        self._open()

    # ------------------------------------------------------------ helpers
    def _tiers(self) -> TierOptions:
        return TierOptions(self.local, close_flush_seconds=2, replicate_every=1000, keep=KEEP)

    def _repair(self) -> tuple[dict[int, Any], int | None]:
        """The open's peer step, both ranks in threads: holdings, plan, write-back, holdings again."""
        own = {r: local_holdings(self.local, "run", r, self.digest, self.auth)[0] for r in (0, 1)}
        peer = {r: peer_holdings(self.local, "run", r, self.digest, self.auth)[0] for r in (0, 1)}
        attempts = durable_attempts(self.url, None, "run", self.auth, None)  # as the coordinator judges zombies
        plan, everywhere, _ = plan_repair(own, peer, 2, attempts)
        wire = Wire(wait=20)
        errors: list[BaseException] = []
        if plan is not None:
            step, attempt, _, _ = plan.target
            _event("a restart wrote a part back from the peer copy")

            def holder(owner: int, h: int) -> None:
                send_held_part(wire.end(h), owner, self.local, h, owner, "run", step, attempt, self.digest,
                               self.auth)

            threads = []
            for owner, h in sorted(plan.fetch.items()):
                t = threading.Thread(target=holder, args=(owner, h))
                t.start()
                threads.append(t)
                frame = receive_frame(wire.end(owner), h, owner, "run")
                if frame is not None:
                    try:
                        write_back(frame, self.local, owner, self.url, None, self.auth, self.digest, None)
                    except (CkptStoreError, OSError) as exc:
                        errors.append(exc)
            for t in threads:
                t.join(30)
        after = {r: local_holdings(self.local, "run", r, self.digest, self.auth) for r in (0, 1)}
        return {1: {"held": after[1][0], "reasons": after[1][1]}}, everywhere

    def _open(self) -> None:
        if self.steps:  # what the durable tier holds now (a close may have replicated the resume point)
            self.durable_known()
        report, everywhere = self._repair() if self.steps else ({1: {"held": [], "reasons": []}}, None)
        wire = Wire(wait=20)
        tiers = self._tiers()
        coord = CheckpointStore.open(self.url, "run", identity=IDENT, options=OpenOptions(
            single_writer=True, protocol_version=self.version, pieces=PieceTiming(window=0.05),
            tiers=replace(tiers, rank=0, peers=report, peer_job=Job(wire.end(0), newest_everywhere=everywhere))))
        assert coord.attempt is not None
        member = CheckpointStore.open(self.url, "run", identity=IDENT, join_attempt=coord.attempt.number,
                                      options=OpenOptions(tiers=replace(tiers, rank=1, peer_job=Job(wire.end(1)))))
        ref = coord.resumed_from
        if ref is not None:
            member.adopt_resume_point(replace(ref, tier=ref.tier))
        self.stores = (coord, member)
        if self.steps:
            self._check_resume(ref)
        self.step = (ref.step + 1) if ref is not None else 0

    def _whole(self, sid: str) -> bool:
        return all(self.intact.get((sid, "own", r)) or self.intact.get((sid, "peer", r)) for r in (0, 1))

    def _check_resume(self, ref: Any) -> None:
        local = [s for sid, s in self.steps.items() if self._whole(sid)]
        best = max(local, default=None)
        want = best if best is not None and (self.durable_step is None or best > self.durable_step) \
            else self.durable_step
        assert (ref.step if ref is not None else None) == want, (ref, want, self.intact)
        _event(f"resumed from the {ref.tier if ref is not None else 'start'}")
        if ref is None:
            return
        coord, member = self.stores  # type: ignore[misc]
        assert coord.read(ref, "rank0/w") == part(ref.step, 0)
        assert member.read(ref, "rank1/w") == part(ref.step, 1)
        if self.version == 3:
            assert coord.read(ref, "rank0/frozen") == FROZEN[0] and member.read(ref, "rank1/frozen") == FROZEN[1]
        # what was written back or read is intact again in the owner's own folder (or the save is durable)
        for sid in [k for k, s in self.steps.items() if s > ref.step]:
            del self.steps[sid]  # a later history starts after the resume point
        for r in (0, 1):
            if (ref.save_id, "own", r) in self.intact and ref.tier != "durable":
                self.intact[(ref.save_id, "own", r)] = True

    def _close(self) -> None:
        assert self.stores is not None
        for s in self.stores:
            s.close()
        self.stores = None

    def _files(self, sid: str, kind: str, r: int) -> Path:
        top = self.local / f"rank-{r}" if kind == "own" else self.local / f"rank-{1 - r}" / ".peers" / f"rank-{r}"
        if self.version == 3:  # the one piece of rank r's ``w`` (new at each step, under the save's own ID)
            (p,) = self.refs[sid].record.components[f"rank{r}/w"].pieces
            return top / "run" / "pieces" / p.holder / p.digest
        return top / "run" / "saves" / sid / f"rank{r}" / "w"

    # -------------------------------------------------------------- rules
    @rule()
    def save(self) -> None:
        assert self.stores is not None
        coord, member = self.stores
        step = self.step
        sid = coord.new_save_id(step)
        a, b = coord.stage(step, save_id=sid), member.stage(step, save_id=sid)
        comps = [a.put("rank0/w", part(step, 0)), b.put("rank1/w", part(step, 1))]
        if self.version == 3:
            comps += [a.put("rank0/frozen", FROZEN[0]), b.put("rank1/frozen", FROZEN[1])]
        ref = coord.publish(step, sid, {c.name: c for c in comps},
                            ranks={r: sorted(c.name for c in comps if c.name.startswith(f"rank{r}/")) for r in (0, 1)},
                            world_size=2)
        member.publish_record(ref.record.encode())
        self.refs[sid] = ref
        # every rank acknowledges on its own (a save waits there until its peer copies landed)
        other = threading.Thread(target=member.acknowledged, args=(ref,))
        other.start()
        coord.acknowledged(ref)
        other.join(30)
        assert coord.flush(30) and member.flush(30)
        self.steps[sid] = step
        for r in (0, 1):
            self.intact[(sid, "own", r)] = True
            self.intact[(sid, "peer", r)] = True
        self._retained()
        self.step += 1

    def _retained(self) -> None:
        """Forget copies retention removed (a folder keeps its newest KEEP saves, plus pending replication)."""
        for sid in self.steps:
            for kind in ("own", "peer"):
                for r in (0, 1):
                    if self.intact.get((sid, kind, r)) and not self._files(sid, kind, r).exists():
                        self.intact[(sid, kind, r)] = False

    @rule(kind=st.sampled_from(["own", "peer"]), rank=st.integers(0, 1),
          how=st.sampled_from(["flip", "truncate", "remove"]))
    def damage_newest(self, kind: str, rank: int, how: str) -> None:
        if not self.steps:
            return
        sid = max(self.steps, key=lambda k: self.steps[k])
        f = self._files(sid, kind, rank)
        if f.exists():
            damage(f, how)
            self.intact[(sid, kind, rank)] = False

    @rule(node=st.integers(0, 1))
    def lose_node(self, node: int) -> None:
        self._close()
        shutil.rmtree(self.local / f"rank-{node}", ignore_errors=True)
        for sid in self.steps:  # its own parts, and the copies it held of the other rank's
            self.intact[(sid, "own", node)] = False
            self.intact[(sid, "peer", 1 - node)] = False
        self._open()

    @rule()
    def restart(self) -> None:
        self._close()
        self._open()

    @invariant()
    def durable_known(self) -> None:
        with CheckpointStore.open(self.url, "run", mode="r") as s:
            latest = s.latest_complete()
            self.durable_step = latest.step if latest is not None else None

    def teardown(self) -> None:
        if self.stores is not None:
            self._close()
        shutil.rmtree(self.dir, ignore_errors=True)


class PeerTiersV3(PeerTiers):
    version = 3


@pytest.mark.backends("local")
@pytest.mark.parametrize("machine", [PeerTiers, PeerTiersV3], ids=["v2", "v3"])
def test_peer_tiers_state_machine(machine: type[PeerTiers]) -> None:
    run_state_machine_as_test(machine, settings=settings(max_examples=8, stateful_step_count=10, deadline=None))


def _fixed(*steps: tuple[str, dict[str, Any]], machine: type[PeerTiers] = PeerTiers) -> None:
    """One fixed run of the machine (the random runs reach a node loss after several saves only now and then)."""
    m = machine()
    try:
        for name, kwargs in steps:
            getattr(m, name)(**kwargs)
            m.durable_known()
    finally:
        m.teardown()


@pytest.mark.backends("local")
def test_a_lost_node_resumes_from_the_peer_copies_of_the_newest_save() -> None:
    _fixed(("save", {}), ("save", {}), ("save", {}), ("lose_node", {"node": 0}), ("save", {}),
           ("lose_node", {"node": 1}))


@pytest.mark.backends("local")
def test_a_damaged_peer_copy_is_never_read_after_a_node_loss() -> None:
    _fixed(("save", {}), ("save", {}), ("damage_newest", {"kind": "peer", "rank": 0, "how": "flip"}),
           ("lose_node", {"node": 0}), ("save", {}), ("damage_newest", {"kind": "peer", "rank": 1, "how": "truncate"}),
           ("lose_node", {"node": 1}), ("restart", {}))


@pytest.mark.backends("local")
def test_version_3_a_lost_node_resumes_from_the_peer_pieces_of_the_newest_save() -> None:
    _fixed(("save", {}), ("save", {}), ("save", {}), ("lose_node", {"node": 0}), ("save", {}),
           ("damage_newest", {"kind": "peer", "rank": 1, "how": "flip"}), ("lose_node", {"node": 1}),
           ("save", {}), ("lose_node", {"node": 0}), ("restart", {}), machine=PeerTiersV3)
