"""The many-rank tier rules on a protocol version 3 run (pieces), in one
process: a coordinator store (rank 0) and a member store (``join_attempt``,
rank 1) on one durable backend, each with its own local tier, as
``open_distributed(..., options=OpenOptions(protocol_version=3, tiers=...))``
wires them. Races are decided by a hook on the durable backend
(:class:`~ckptstore.backends.faults.FaultyBackend`), never by sleeping for a
race to happen."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions, TierOptions
from ckptstore import protocol as P
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend
from ckptstore.backends.local import LocalBackend
from ckptstore.core.intents import PieceTiming
from ckptstore.core.record_auth import RecordAuth
from ckptstore.errors import NotFoundError, SaveAbortedError
from ckptstore.protocol.selection import SaveRef
from ckptstore.tiers.parts import local_holdings, rank_root
from tests.incremental.common import GRACE, LONG, Clock, long_timing

IDENT = {"model": "tiny", "world_size": 2}
RUN = "run"
V3 = P.layout_of(3)
#: each rank's frozen part (the same at every step: its pieces are reused)
FROZEN = {r: os.urandom(2 << 20) for r in (0, 1)}


def pair(tmp_path: Path, durable: Backend, timing: PieceTiming) -> tuple[CheckpointStore, CheckpointStore]:
    tiers = TierOptions(tmp_path / "local", close_flush_seconds=0.5, keep=5)
    coord = CheckpointStore.open(durable, RUN, identity=IDENT, options=OpenOptions(
        single_writer=True, protocol_version=3, pieces=timing, tiers=replace(tiers, rank=0, peers={})))
    assert coord.attempt is not None
    member = CheckpointStore.open(durable, RUN, identity=IDENT, join_attempt=coord.attempt.number,
                                  options=OpenOptions(pieces=timing, tiers=replace(tiers, rank=1)))
    return coord, member


def head(step: int, rank: int) -> bytes:
    return f"head@{step}:{rank}".encode() * 3000


def save(coord: CheckpointStore, member: CheckpointStore, step: int, *, member_publishes: bool = True,
         before_member: Any = None) -> SaveRef:
    sid = coord.new_save_id(step)
    comps = {}
    for r, store in ((0, coord), (1, member)):
        staged = store.stage(step, save_id=sid)
        for e in (staged.put(f"rank{r}/frozen", FROZEN[r]), staged.put(f"rank{r}/head", head(step, r))):
            comps[e.name] = e
    ref = coord.publish(step, sid, comps, ranks={r: [f"rank{r}/frozen", f"rank{r}/head"] for r in (0, 1)},
                        world_size=2)
    if before_member is not None:
        before_member(ref)
    if member_publishes:
        mref = member.publish_record(ref.record.encode())
        assert (mref.save_id, mref.manifest_digest) == (ref.save_id, ref.manifest_digest)
    return ref


def piece_files(tmp_path: Path, rank: int, holder: str) -> list[Path]:
    return sorted((rank_root(tmp_path / "local", rank) / RUN / "pieces" / holder).glob("*"))


def check_durable(durable: Backend, ref: SaveRef) -> None:
    """The durable tier's newest save is ``ref``, verifies deep, and reads back every rank's part bit for bit."""
    with CheckpointStore.open(durable, RUN, mode="r") as r:
        got = r.latest_complete(deep=True)
        assert got is not None and got.manifest_digest == ref.manifest_digest  # the same record bytes
        assert r.verify(got, deep=True).ok
        for rank in (0, 1):
            assert r.read(got, f"rank{rank}/frozen") == FROZEN[rank]
            assert r.read(got, f"rank{rank}/head") == head(ref.step, rank)


def test_each_rank_writes_and_replicates_only_its_parts_new_pieces_and_its_holdings_rehash_them(
        tmp_path: Path) -> None:
    durable = FaultyBackend(LocalBackend(tmp_path / "durable"))
    coord, member = pair(tmp_path, durable, long_timing())
    r1 = save(coord, member, 1)
    assert coord.flush(20) and member.flush(20) and coord.is_durable(r1)
    mark = len(durable.trace)
    r2 = save(coord, member, 2)
    for rank in (0, 1):  # each local tier: its own part's pieces only, the frozen ones not written again
        assert sum(p.stat().st_size for p in piece_files(tmp_path, rank, r1.save_id)) >= len(FROZEN[rank])
        assert 0 < sum(p.stat().st_size for p in piece_files(tmp_path, rank, r2.save_id)) < len(FROZEN[rank]) // 10
    assert coord.flush(20) and member.flush(20) and coord.is_durable(r2)
    sizes = {P.layout.piece_key(RUN, h, d): n for (h, d), n in r2.record.piece_refs().items()}
    put = sum(sizes.get(t.key, 0) for t in durable.trace[mark:] if t.op == "put" and t.outcome == "ok")
    new = sum(n for (h, _), n in r2.record.piece_refs().items() if h == r2.save_id)
    assert put == new  # only the pieces the durable tier lacked went up, once each
    check_durable(durable, r2)
    coord.close()
    member.close()
    auth = RecordAuth("off", None)
    for rank in (0, 1):  # each rank's holdings check verifies its part, pieces included
        held, why = local_holdings(tmp_path / "local", RUN, rank, coord.identity_digest, auth)
        assert [h["save_id"] for h in held] == [r2.save_id, r1.save_id] and not why
    victim = piece_files(tmp_path, 1, r2.save_id)[0]  # one bit flips in one of rank 1's pieces of step 2
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x80
    victim.write_bytes(bytes(data))
    held, why = local_holdings(tmp_path / "local", RUN, 1, coord.identity_digest, auth)
    assert [h["save_id"] for h in held] == [r1.save_id] and "BLAKE3" in why[0]


def test_a_rank_whose_pieces_never_reach_the_durable_tier_never_leads_to_a_durable_commit(tmp_path: Path) -> None:
    durable = LocalBackend(tmp_path / "durable")
    coord, member = pair(tmp_path, durable, long_timing())
    r1 = save(coord, member, 1)
    assert coord.flush(20) and member.flush(20)
    r2 = save(coord, member, 2, member_publishes=False)  # rank 1's part never committed, never uploaded
    assert not coord.flush(3)
    status = coord.replication_status()
    assert status is not None and status.failures >= 1 and "not yet in the durable tier" in str(status.last_error)
    assert "rank(s) [1]" in str(status.last_error)
    assert not coord.is_durable(r2)
    with CheckpointStore.open(durable, RUN, mode="r") as r:
        with pytest.raises(NotFoundError):
            r.get_save(2)
    check_durable(durable, r1)
    coord.close()
    member.close()


def test_a_member_commits_its_part_only_when_its_pieces_are_in_its_local_tier(tmp_path: Path) -> None:
    durable = LocalBackend(tmp_path / "durable")
    coord, member = pair(tmp_path, durable, long_timing())

    def lose_a_piece(ref: SaveRef) -> None:
        piece_files(tmp_path, 1, ref.save_id)[0].unlink()  # rank 1's disk lost one of its new pieces

    ref = save(coord, member, 1, member_publishes=False, before_member=lose_a_piece)
    with pytest.raises(SaveAbortedError, match="missing"):
        member.publish_record(ref.record.encode())
    assert not list((rank_root(tmp_path / "local", 1) / RUN / "commits").glob("*"))  # nothing committed
    held, _ = local_holdings(tmp_path / "local", RUN, 1, coord.identity_digest, RecordAuth("off", None))
    assert held == []
    coord.close()
    member.close()


def test_durable_gc_during_a_members_upload_keeps_the_pieces_its_part_reuses(tmp_path: Path) -> None:
    """Save A is made durable; save B reuses A's pieces. At rank 1's first
    upload of B's new pieces, A's durable commit is removed and a gc of the
    durable tier runs with A's pieces past the grace period: rank 1's intent
    (written before it uploads, at least ``window`` old) names the pieces its
    part reuses, so gc keeps them and rank 1 never uploads them; B's durable
    commit (the coordinator's, after every piece is listed) verifies and reads
    back every rank's part bit for bit.

    Decided by injected clocks: both ranks' clock is moved past half the
    standing intents' life (B's replication writes fresh ones), and gc's
    clock is fixed where A's pieces are just old and B's, written a second
    or more later, young."""
    inner = LocalBackend(tmp_path / "durable")
    durable = FaultyBackend(inner)
    clock = Clock()
    coord, member = pair(tmp_path, durable, long_timing(clock))
    a = save(coord, member, 1)
    assert coord.flush(20) and member.flush(20) and coord.is_durable(a)
    time.sleep(1.1)  # a lower bound only: B's pieces are written at least a second after A's
    clock.offset = LONG / 2 + 1  # every standing intent is past half its life: B's replication writes fresh ones
    gclock = Clock(fixed=max(o.mtime for o in inner.list(P.layout.pieces_prefix(RUN))) + LONG + 0.5)
    member_keys = {P.layout.piece_key(RUN, p.holder, p.digest)
                   for n in ("rank1/frozen", "rank1/head") for p in a.components[n].pieces or ()}
    fired: list[int] = []

    def gc_now(op: str, key: str) -> bool:
        if not fired and op == "put" and key in member_new:
            inner.delete(V3.commit_key(RUN, 1, 1))  # another job's retention took A away
            report = CheckpointStore.open(inner, RUN, piece_timing=long_timing(gclock)).gc(
                keep_last=1, grace_seconds=GRACE)
            fired.append(report.pieces_freed)
        return False

    member_new: set[str] = set()  # the keys of rank 1's new pieces of B

    def arm(ref: SaveRef) -> None:
        member_new.update(P.layout.piece_key(RUN, p.holder, p.digest) for p in ref.components["rank1/head"].pieces
                          or () if p.holder == ref.save_id)
        durable.crash_when(gc_now)  # never crashes: a hook at rank 1's first upload of its new pieces

    mark = len(durable.trace)
    b = save(coord, member, 2, before_member=arm)
    assert coord.flush(20) and member.flush(20)
    assert fired and fired[0] >= 2, fired  # gc ran and swept what only A named (each rank's head)
    reused = {P.layout.piece_key(RUN, p.holder, p.digest) for n in ("rank1/frozen",)
              for p in b.components[n].pieces or () if p.holder == a.save_id}
    assert reused and reused <= member_keys  # rank 1's part relies on A's pieces
    assert not [t for t in durable.trace[mark:] if t.op == "put" and t.key in reused]  # kept by gc, never re-sent
    check_durable(inner, b)
    coord.close()
    member.close()
