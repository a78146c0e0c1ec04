"""The many-rank tier rules in one process (no process group): a coordinator
store (``tier_rank=0``) and a member store (``join_attempt``, ``tier_rank=1``)
on one durable directory, each with its own local tier directory, as
``open_distributed(..., local_tier=...)`` wires them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions, TierOptions
from ckptstore.core.record_auth import RecordAuth
from ckptstore.errors import InvalidInputError, NotFoundError
from ckptstore.tiers.parts import local_holdings, rank_root

IDENT = {"model": "tiny", "world_size": 2}
#: these tests damage and time version 2's whole-component parts; version 3's pieces: tests/tiers/test_parts_v3.py
VERSION = 2


def pair(tmp_path: Path, peers: dict[int, Any] | None = None, every: int = 1) -> tuple[CheckpointStore, CheckpointStore]:
    url = str(tmp_path / "durable")
    tiers = TierOptions(tmp_path / "local", close_flush_seconds=0.5, replicate_every=every, keep=5)
    coord = CheckpointStore.open(url, "run", identity=IDENT, options=OpenOptions(
        single_writer=True, protocol_version=VERSION, tiers=replace(tiers, rank=0, peers=peers or {})))
    assert coord.attempt is not None
    member = CheckpointStore.open(url, "run", identity=IDENT, join_attempt=coord.attempt.number,
                                  options=OpenOptions(tiers=replace(tiers, rank=1)))
    return coord, member


def save(coord: CheckpointStore, member: CheckpointStore, step: int, *, member_publishes: bool = True) -> Any:
    sid = coord.new_save_id(step)
    a, b = coord.stage(step, save_id=sid), member.stage(step, save_id=sid)
    ca = a.put("rank0/w", bytes([step]) * 5000)
    cb = b.put("rank1/w", bytes([step + 1]) * 7000)
    ref = coord.publish(step, sid, {ca.name: ca, cb.name: cb}, ranks={0: [ca.name], 1: [cb.name]}, world_size=2)
    if member_publishes:
        mref = member.publish_record(ref.record.encode())
        assert (mref.save_id, mref.manifest_digest) == (ref.save_id, ref.manifest_digest)
    return ref


def test_each_tier_holds_its_part_and_the_durable_commit_waits_for_both(tmp_path: Path) -> None:
    coord, member = pair(tmp_path)
    ref = save(coord, member, 1)
    assert ref.tier == "local"
    # each local tier holds only its own rank's component, and its selection accepts that part
    assert not (rank_root(tmp_path / "local", 0) / "run" / "saves" / ref.save_id / "rank1").exists()
    assert member.flush(10) and coord.flush(10)
    assert coord.is_durable(ref)
    with CheckpointStore.open(str(tmp_path / "durable"), "run") as reader:
        got = reader.latest_complete(deep=True)
        assert got is not None and got.manifest_digest == ref.manifest_digest  # the same record bytes
        assert reader.read(got, "rank1/w") == bytes([2]) * 7000
    coord.close()
    member.close()


def test_a_rank_that_never_uploads_never_leads_to_a_durable_commit(tmp_path: Path) -> None:
    coord, member = pair(tmp_path)
    save(coord, member, 1)
    assert coord.flush(10) and member.flush(10)
    ref = save(coord, member, 2, member_publishes=False)  # rank 1's part never committed, never uploaded
    assert not coord.flush(3)
    status = coord.replication_status()
    assert status is not None and status.failures >= 1 and "not yet in the durable tier" in str(status.last_error)
    with CheckpointStore.open(str(tmp_path / "durable"), "run") as reader:
        latest = reader.latest_complete()
        assert latest is not None and latest.step == 1
        with pytest.raises(NotFoundError):
            reader.get_save(2)
    assert not coord.is_durable(ref)
    coord.close()
    member.close()


def test_holdings_report_only_parts_that_verify(tmp_path: Path) -> None:
    coord, member = pair(tmp_path)
    r1 = save(coord, member, 1)
    r2 = save(coord, member, 2)
    coord.flush(10)
    member.flush(10)
    coord.close()
    member.close()
    root = rank_root(tmp_path / "local", 1)
    auth = RecordAuth("off", None)
    held, why = local_holdings(tmp_path / "local", "run", 1, coord.identity_digest, auth)
    assert [h["save_id"] for h in held] == [r2.save_id, r1.save_id] and not why
    victim = root / "run" / "saves" / r2.save_id / "rank1" / "w"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x80
    victim.write_bytes(bytes(data))
    held, why = local_holdings(tmp_path / "local", "run", 1, coord.identity_digest, auth)
    assert [h["save_id"] for h in held] == [r1.save_id]
    assert "BLAKE3" in why[0]
    assert local_holdings(tmp_path / "nowhere", "run", 1, coord.identity_digest, auth) == (
        [], [f"rank 1: no local tier of this run at {tmp_path / 'nowhere' / 'rank-1'}"])


def test_the_coordinator_resumes_locally_only_when_every_rank_holds_the_part(tmp_path: Path) -> None:
    coord, member = pair(tmp_path)
    save(coord, member, 1)
    coord.flush(10)
    member.flush(10)
    coord.close()
    member.close()
    # rank 0 holds step 1 locally; which tier the job resumes from depends on what rank 1 reports
    held, _ = local_holdings(tmp_path / "local", "run", 1, coord.identity_digest, RecordAuth("off", None))
    c2, m2 = pair(tmp_path, peers={1: {"held": held, "reasons": []}})
    assert c2.resumed_from is not None and c2.resumed_from.tier == "both"
    c2.close()
    m2.close()
    c3, m3 = pair(tmp_path, peers={1: {"held": [], "reasons": ["rank 1: no local tier"]}})
    assert c3.resumed_from is not None and c3.resumed_from.tier == "durable"
    events = [e for e in c3.events() if e["event"] == "resume-tier"]
    assert events[-1]["payload"]["ranks"]["1"]["reasons"] == ["rank 1: no local tier"]
    c3.close()
    m3.close()


def test_a_member_needs_its_rank(tmp_path: Path) -> None:
    coord, member = pair(tmp_path)
    assert coord.attempt is not None
    with pytest.raises(InvalidInputError, match="needs the rank's tier"):
        CheckpointStore.open(str(tmp_path / "durable"), "run", identity=IDENT, join_attempt=coord.attempt.number,
                             local_tier=tmp_path / "x")
    coord.close()
    member.close()


def test_the_newest_save_every_rank_holds_wins_over_an_older_durable_one(tmp_path: Path) -> None:
    coord, member = pair(tmp_path, every=10)  # step 1 replicated, steps 2 and 3 local only
    save(coord, member, 1)
    r2 = save(coord, member, 2)
    save(coord, member, 3)
    coord.flush(10)
    member.flush(10)
    coord.close()
    member.close()
    held, _ = local_holdings(tmp_path / "local", "run", 1, coord.identity_digest, RecordAuth("off", None))
    assert [h["step"] for h in held] == [3, 2]  # the newest two that verify
    # rank 1 lost step 3 (say its local commit failed): the job resumes from step 2, locally, on every rank
    c2, m2 = pair(tmp_path, peers={1: {"held": held[1:], "reasons": []}})
    assert c2.resumed_from is not None and (c2.resumed_from.step, c2.resumed_from.tier) == (2, "local")
    assert c2.resumed_from.save_id == r2.save_id
    d = [e for e in c2.events() if e["event"] == "resume-tier"][-1]["payload"]
    # step 3 was never acknowledged (its part is missing on rank 1): nothing acknowledged was lost
    assert d["steps_lost_with_local_tier"] == 0
    c2.close()
    m2.close()


def test_the_dcp_writer_is_refused_on_a_tiered_job_of_many_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.checkpoint")
    from ckptstore.distributed.dcp.writer import StoreWriter

    coord, member = pair(tmp_path)
    for store in (coord, member):
        with pytest.raises(InvalidInputError, match="not supported yet"):
            StoreWriter(store, 1)
    coord.close()
    member.close()
