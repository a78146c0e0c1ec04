"""Peer copies with real processes (gloo, world size 2), each rank its own
"node" (``TierOptions.node``) with its own folder under one job root standing
for its node's disk: rank 0's part is also kept by rank 1 (in
``rank-1/.peers/rank-0``) and rank 1's by rank 0. Losing a node is deleting
its rank folder (its own parts and the peer copies it held)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from tests.workers.dist_launch import RankResult, run_job
from tests.workers.dist_worker import blob

pytest.importorskip("torch.distributed")

WORKER = str(Path(__file__).parents[1] / "workers" / "tier_rank_worker.py")
NODES = {"0": "node-a", "1": "node-b"}
#: the base job's run: its tests count, flip and truncate version 2's whole-component peer copies
#: (version 3's pieces: test_a_version_3_job_sends_only_the_pieces_a_holder_lacks_..., tests/fail_closed/test_peer_pieces.py)
BASE_VERSION = 2


def job(base: Path, **args: Any) -> list[RankResult]:
    res = run_job(2, str(base / "durable"), "tiers", args={"local": str(base / "local"), "nodes": NODES, **args},
                  worker=WORKER, timeout=90)
    for r in res:
        if not r.killed:
            assert r.returncode == 0, r.stderr[-3000:]
            assert r.results.get("open", {}).get("ok"), (r.results, r.stderr[-3000:])
    return res


def resume_tier(base: Path) -> dict[str, Any]:
    with CheckpointStore.open(str(base / "durable"), "run") as s:
        return [e for e in s.events() if e["event"] == "resume-tier"][-1]["payload"]


def opened(res: list[RankResult]) -> list[tuple[int | None, str | None]]:
    return [(r.results["open"]["resumed"], r.results["open"]["tier"]) for r in res]


def peer_files(base: Path, holder: int, sender: int) -> set[str]:
    top = base / "local" / f"rank-{holder}" / ".peers" / f"rank-{sender}" / "run" / "saves"
    return {p.relative_to(top).as_posix() for p in top.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def base_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 (durable) and 2, 3 (local tiers and their peer copies only: replicate_every=3)."""
    base = tmp_path_factory.mktemp("peers")
    res = job(base, steps=[1, 2, 3], every=3, flush=20, protocol_version=BASE_VERSION)
    for r in res:
        assert all(r.results[f"save{s}"]["ok"] for s in (1, 2, 3)), r.results
        st = r.results["flush"]["status"]
        assert st["peer_copies"] == "on", st
        roles = {(p["role"], p["peer"]): p for p in st["peers"]}
        other = 1 - r.rank
        assert set(roles) == {("sends-to", other), ("receives-from", other)}, st
        assert roles[("sends-to", other)]["copies"] == 3 and roles[("receives-from", other)]["copies"] == 3, st
        assert roles[("sends-to", other)]["failures"] == 0, st
    with CheckpointStore.open(str(base / "durable"), "run") as s:
        latest = s.latest_complete()
        assert latest is not None and latest.step == 1
    sent = {r.rank: {p["role"]: p["bytes"] for p in r.results["flush"]["status"]["peers"]} for r in res}
    for holder in (0, 1):
        sender = 1 - holder
        # bytes per save = k (1) x the part: the sender's components of each of its 3 saves
        part = sum(len(blob(step, sender)) + len(blob(step, sender, 3000)) for step in (1, 2, 3))
        assert sent[sender]["sends-to"] == sent[holder]["receives-from"] == part, sent
        got = peer_files(base, holder, sender)
        # the sender's part only, of the newest `keep` (2) saves: steps 2 and 3
        assert {f.split("/", 1)[1] for f in got} == {f"rank{sender}/model", f"rank{sender}/extra"}, got
        assert len({f.split("/", 1)[0] for f in got}) == 2, got
    return base


@pytest.fixture
def restart(base_job: Path, tmp_path: Path) -> Path:
    shutil.copytree(base_job, tmp_path / "job")
    return tmp_path / "job"


def test_losing_one_node_resumes_from_the_peer_copy_with_no_step_lost(restart: Path) -> None:
    shutil.rmtree(restart / "local" / "rank-1")  # node b's disk: its own parts and the copies it held
    res = job(restart, steps=[], flush=20)
    assert opened(res) == [(3, "local"), (3, "local")]
    assert all(r.results["read"]["ok"] for r in res)  # rank 1's part, written back, verified, bit for bit
    d = resume_tier(restart)
    assert d["tier"] == "local" and d["step"] == 3 and d["steps_lost_with_local_tier"] == 0, d
    assert d["ranks"]["1"]["source"] == {"step": 3, "from": "peer", "holder": 0, "ok": True}, d
    assert d["ranks"]["0"]["source"] == {"step": 3, "from": "own"}, d
    # written back: the replaced node holds its own part again
    assert (restart / "local" / "rank-1" / "run" / "commits").is_dir()


def test_both_nodes_intact_resume_locally_without_any_transfer(restart: Path) -> None:
    res = job(restart, steps=[], flush=20)
    assert opened(res) == [(3, "local"), (3, "local")]
    d = resume_tier(restart)
    assert d["steps_lost_with_local_tier"] == 0 and all("source" not in v or v["source"] is None
                                                         for v in d["ranks"].values()), d


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_peer_copy_is_never_used_and_the_job_falls_back_to_durable(restart: Path) -> None:
    shutil.rmtree(restart / "local" / "rank-1")
    copies = restart / "local" / "rank-0" / ".peers" / "rank-1" / "run" / "saves"
    for f in copies.rglob("model"):
        _flip(f)
    res = job(restart, steps=[], flush=20)
    assert opened(res) == [(1, "durable"), (1, "durable")]  # no save is held whole anywhere but durably
    assert all(r.results["read"]["ok"] for r in res)
    d = resume_tier(restart)
    assert d["step"] == 1 and d["steps_lost_with_local_tier"] == 2, d


def test_a_truncated_peer_copy_falls_back_to_durable(restart: Path) -> None:
    shutil.rmtree(restart / "local" / "rank-1")
    copies = restart / "local" / "rank-0" / ".peers" / "rank-1" / "run" / "saves"
    for f in copies.rglob("extra"):
        f.write_bytes(f.read_bytes()[:-7])
    res = job(restart, steps=[], flush=20)
    assert opened(res) == [(1, "durable"), (1, "durable")]
    assert all(r.results["read"]["ok"] for r in res)


def test_peer_copies_are_off_on_one_node_and_say_so(tmp_path: Path) -> None:
    res = run_job(2, str(tmp_path / "durable"), "tiers", args={"local": str(tmp_path / "local"), "steps": [1],
                                                               "flush": 20, "nodes": {"0": "n", "1": "n"}},
                  worker=WORKER, timeout=90)
    for r in res:
        assert r.returncode == 0, r.stderr[-3000:]
        st = r.results["flush"]["status"]
        assert st["peer_copies"] == "every rank is on one node" and st["peers"] == [], json.dumps(st)
    assert not (tmp_path / "local" / "rank-0" / ".peers").exists()


def test_a_peer_killed_during_its_copy_leaves_that_save_incomplete_and_the_partial_copy_unused(
        tmp_path: Path) -> None:
    """Rank 1 dies part way into sending its copy of step 3 (acknowledged on both
    ranks): rank 0's copy thread stops and says so, and rank 0's save of step 3
    is :class:`CommitUnknownError` (committed on every rank, its copies did not
    land: not complete). Node 1's disk is then lost. Rank 0 holds no complete
    copy of rank 1's step 3, so the job resumes from step 2 (rank 1's part
    written back from rank 0's copy): the newest complete save, no step of a
    complete save lost."""
    res = job(tmp_path, steps=[1, 2, 3], every=5, flush=20, kill_in_copy={"rank": 1, "step": 3})
    r0 = next(r for r in res if r.rank == 0)
    assert r0.results["save2"]["ok"], r0.results
    assert not r0.results["save3"]["ok"] and r0.results["save3"]["type"] == "CommitUnknownError", r0.results
    assert "peer copies did not land" in r0.results["save3"]["message"], r0.results
    st = r0.results["flush"]["status"]
    assert st["peer_copies"].startswith("stopped: "), st  # visible: the peer went away mid-frame
    got = {(p["role"], p["peer"]): p for p in st["peers"]}
    assert got[("receives-from", 1)]["copies"] == 2 and got[("receives-from", 1)]["stopped"], st
    with CheckpointStore.open(str(tmp_path / "durable"), "run") as s:
        events = s.events()
        assert any(e["event"] == "peer-copy-stopped" for e in events)
        assert sorted(e["payload"]["step"] for e in events if e["event"] == "acknowledged") == [1, 2]
    shutil.rmtree(tmp_path / "local" / "rank-1")
    res = job(tmp_path, steps=[], flush=20)
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)
    d = resume_tier(tmp_path)
    assert d["steps_lost_with_local_tier"] == 0 and d["newest_held_by_every_rank"] == 2, d
    assert d["ranks"]["1"]["source"]["from"] == "peer", d


def test_under_require_the_written_back_part_carries_the_tagged_record_and_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Authenticated records x peer copies: the copy is the coordinator's tagged
    record bytes; a lost node's part comes back under ``require`` and resumes."""
    import os
    import secrets

    from ckptstore.protocol import CommitRecord

    monkeypatch.delenv("CKPTSTORE_AUTH_KEYS", raising=False)
    kf = tmp_path / "keys.json"
    kf.write_text(json.dumps({"active": "k1", "keys": {"k1": secrets.token_hex(32)}}))
    os.chmod(kf, 0o600)
    first = job(tmp_path, steps=[1, 2], every=5, flush=20, key_file=str(kf))
    assert all(r.results["save2"]["ok"] for r in first), [r.results for r in first]
    commits = tmp_path / "local" / "rank-0" / ".peers" / "rank-1" / "run" / "commits"
    recs = [CommitRecord.decode(p.read_bytes(), "a peer copy") for p in commits.iterdir() if p.suffix == ".json"]
    assert {r.step for r in recs} == {1, 2} and all(r.auth is not None and r.auth.key_id == "k1" for r in recs)
    shutil.rmtree(tmp_path / "local" / "rank-1")
    res = job(tmp_path, steps=[], flush=20, key_file=str(kf))
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)


def test_a_version_3_job_sends_only_the_pieces_a_holder_lacks_and_a_lost_node_costs_no_step(tmp_path: Path) -> None:
    """Version 3 x peer copies (on by default): each rank's part travels as its
    pieces, and a holder asks only for those it does not hold intact — the
    frozen component (the same bytes at every step) crosses the link once.
    Losing node b resumes from its written-back pieces with no step lost."""
    from tests.workers.tier_rank_worker import frozen

    res = job(tmp_path, steps=[1, 2, 3], every=5, flush=20, protocol_version=3)
    for r in res:
        assert all(r.results[f"save{s}"]["ok"] for s in (1, 2, 3)), r.results
        st = r.results["flush"]["status"]
        assert st["peer_copies"] == "on", st
        got = {(p["role"], p["peer"]): p for p in st["peers"]}
        other = 1 - r.rank
        assert got[("receives-from", other)]["copies"] == 3 and got[("sends-to", other)]["failures"] == 0, st
        changing = sum(len(blob(step, other)) + len(blob(step, other, 3000)) for step in (1, 2, 3))
        assert got[("receives-from", other)]["bytes"] == changing + len(frozen(other)), st
        assert got[("sends-to", other)]["bytes"] == got[("receives-from", other)]["bytes"], st
        assert "PeerCopiesOffWarning" not in r.stderr
    pieces = tmp_path / "local" / "rank-0" / ".peers" / "rank-1" / "run" / "pieces"
    assert pieces.is_dir() and not (tmp_path / "local" / "rank-0" / ".peers" / "rank-1" / "run" / "saves").exists()
    shutil.rmtree(tmp_path / "local" / "rank-1")
    res = job(tmp_path, steps=[], flush=20, protocol_version=3)
    assert opened(res) == [(3, "local"), (3, "local")]
    assert all(r.results["read"]["ok"] for r in res)  # model and the frozen part, bit for bit
    d = resume_tier(tmp_path)
    assert d["steps_lost_with_local_tier"] == 0 and d["ranks"]["1"]["source"]["from"] == "peer", d


def test_explicit_peer_copies_on_a_version_3_run_bring_back_the_coordinators_part(tmp_path: Path) -> None:
    res = job(tmp_path, steps=[1, 2], every=5, flush=20, protocol_version=3, peer_copies=1)
    assert all(r.results["save2"]["ok"] for r in res), [r.results for r in res]
    shutil.rmtree(tmp_path / "local" / "rank-0")  # node a: the coordinator's disk
    res = job(tmp_path, steps=[3], flush=20, protocol_version=3, peer_copies=1)
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] and r.results["save3"]["ok"] for r in res)
    d = resume_tier(tmp_path)
    assert d["ranks"]["0"]["source"] == {"step": 2, "from": "peer", "holder": 1, "ok": True}, d
