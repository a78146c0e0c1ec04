"""Two tiers on many ranks, with real processes (gloo, world size 2) on a
local-directory durable tier: each rank's local tier is its own directory
(``<local>/rank-<r>``, standing for its node's disk).

A base job saves step 1 (replicated: durable) and step 2 (``replicate_every=2``:
committed in both local tiers only); each test restarts from a copy of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore.errors import NotFoundError
from tests.tiers.test_kill import durable_location
from tests.workers.dist_launch import RankResult, run_job

pytest.importorskip("torch.distributed")

WORKER = str(Path(__file__).parents[1] / "workers" / "tier_rank_worker.py")
IDENT = {"data_digest": "d", "code_digest": "c", "world_size": 2}
#: the base job's run: its tests look at and damage version 2's whole-component parts in the local
#: tiers (version 3's pieces on many ranks: tests/tiers/test_many_ranks_v3.py)
BASE_VERSION = 2


def job(base: Path, *, url: str | None = None, opts: dict[str, Any] | None = None, **args: Any) -> list[RankResult]:
    """A 2-rank job; the durable tier is ``base/durable`` unless ``url`` (with ``opts``) names another."""
    res = run_job(2, url or str(base / "durable"), "tiers", opts=opts, args={"local": str(base / "local"), **args},
                  worker=WORKER, timeout=90)
    for r in res:
        if not r.killed:
            assert r.returncode == 0, r.stderr[-3000:]
            assert r.results.get("open", {}).get("ok"), (r.results, r.stderr[-3000:])
    return res


def durable(base: Path, url: str | None = None, opts: dict[str, Any] | None = None) -> CheckpointStore:
    return CheckpointStore.open(url or str(base / "durable"), "run", storage_options=opts or None)


def resume_tier(base: Path) -> dict[str, Any]:
    with durable(base) as s:
        return [e for e in s.events() if e["event"] == "resume-tier"][-1]["payload"]


@pytest.fixture(scope="module")
def base_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("base")
    res = job(base, steps=[1, 2], every=2, flush=20, protocol_version=BASE_VERSION)
    for r in res:
        assert r.results["save1"]["ok"] and r.results["save2"]["ok"], r.results
        assert r.results["flush"]["ok"], r.results
    with durable(base) as s:
        latest = s.latest_complete()
        assert latest is not None and latest.step == 1  # step 2 is in the local tiers only
    for r in (0, 1):
        names = {p.name for p in (base / "local" / f"rank-{r}" / "run" / "saves").rglob("*") if p.is_file()}
        assert names == {"model", "extra"}  # each node's tier holds its own rank's components only
    return base


@pytest.fixture
def restart(base_job: Path, tmp_path: Path) -> Path:
    shutil.copytree(base_job, tmp_path / "job")
    return tmp_path / "job"


def opened(res: list[RankResult]) -> list[tuple[int | None, str | None]]:
    return [(r.results["open"]["resumed"], r.results["open"]["tier"]) for r in res]


def test_both_nodes_intact_resume_from_the_local_tiers_and_catch_up(restart: Path) -> None:
    res = job(restart, steps=[], flush=20)
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)  # each rank's part, verified, from its own disk
    d = resume_tier(restart)
    assert d["tier"] == "local" and d["step"] == 2 and d["ranks"]["1"]["held_steps"][0] == 2
    with durable(restart) as s:  # the resumed local-only save was replicated, both parts, then committed
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 2


def test_one_node_lost_every_rank_reads_the_durable_copy(restart: Path) -> None:
    shutil.rmtree(restart / "local" / "rank-1")  # node 1 was replaced: its disk is empty
    res = job(restart, steps=[3], flush=20)
    assert opened(res) == [(1, "durable"), (1, "durable")]  # all ranks or none: rank 0's local copy is not used
    assert all(r.results["read"]["ok"] for r in res)  # bit for bit, from the durable tier
    d = resume_tier(restart)
    assert d["tier"] == "durable" and d["step"] == 1
    assert d["steps_lost_with_local_tier"] == 1  # step 2 existed only in the local tiers
    assert "no local tier" in d["ranks"]["1"]["reasons"][0]
    assert any("rank(s) [1]" in r for r in d["local_reasons"])
    with durable(restart) as s:
        latest = s.latest_complete()
        assert latest is not None and latest.step == 3  # training went on and replicated


def test_a_corrupt_local_part_on_one_rank_reads_the_durable_copy(restart: Path) -> None:
    (model,) = [p for p in (restart / "local" / "rank-1" / "run" / "saves").glob("000000000002-*/rank1/model")]
    data = bytearray(model.read_bytes())
    data[1000] ^= 0x01  # one bit flip, same size
    model.write_bytes(bytes(data))
    res = job(restart, steps=[], flush=5)
    assert opened(res) == [(1, "durable"), (1, "durable")]
    assert all(r.results["read"]["ok"] for r in res)
    d = resume_tier(restart)
    assert d["ranks"]["1"]["held_steps"] == [1]
    assert "BLAKE3" in d["ranks"]["1"]["reasons"][0]


def test_a_superseded_attempts_local_saves_are_never_selected_or_replicated(restart: Path) -> None:
    # a newer attempt registered in the durable tier resuming from step 1: attempt 1's step 2 (in the
    # local tiers only) is a zombie's save from now on
    with CheckpointStore.open(str(restart / "durable"), "run", identity=IDENT, resume_from=1, single_writer=True):
        pass
    res = job(restart, steps=[], flush=5)
    assert [s for s, _ in opened(res)] == [1, 1]
    assert all(r.results["read"]["ok"] for r in res)
    with durable(restart) as s:
        with pytest.raises(NotFoundError):
            s.get_save(2, 1)
        latest = s.latest_complete()
        assert latest is not None and latest.step == 1


@pytest.mark.backends("local", "seaweedfs")
def test_durable_commit_only_once_every_rank_uploaded(backend_kind: str, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    url, opts = durable_location(backend_kind, tmp_path, request)
    # rank 1 is killed as its replicator starts uploading its part of step 2
    res = job(tmp_path, url=url, opts=opts, steps=[1, 2], flush=2.5, close_flush=1, kill={"rank": 1, "step": 2})
    assert res[1].killed and not res[0].killed
    assert res[0].results["save2"]["ok"]  # committed in both local tiers
    assert not res[0].results["flush"]["ok"]  # ... but never made durable: rank 1's part is missing
    with durable(tmp_path, url, opts) as s:
        latest = s.latest_complete()
        assert latest is not None and latest.step == 1  # the previous durable save stays selected
        with pytest.raises(NotFoundError):
            s.get_save(2)
    res = job(tmp_path, url=url, opts=opts, steps=[], flush=20)  # the restart resumes locally and catches up
    assert opened(res) == [(2, "local"), (2, "local")]
    with durable(tmp_path, url, opts) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 2


@pytest.mark.slow
def test_checkpointer_on_rank_stores_resumes_from_the_local_tiers_exactly(tmp_path: Path) -> None:
    first = job(tmp_path, stop=7, flush=20)  # saves every 2 steps, each committed locally and replicated
    assert [r.results["durable"]["ok"] for r in first] == [True, True]  # the last save, every rank's part
    res = job(tmp_path, stop=7, flush=20)  # restarts from the newest save, read from both local tiers
    assert [t for _, t in opened(res)] == ["both", "both"]
    for a, b in zip(first, res, strict=True):
        start = b.results["ckpt"]["start"]
        assert 0 < start < 7
        tail = {k: v for k, v in a.results["ckpt"]["draws"].items() if int(k) >= start}
        assert b.results["ckpt"]["draws"] == tail  # RNG streams and data position, per rank, exactly
    d = resume_tier(tmp_path)
    assert d["tier"] == "local"


def local_commits(base: Path, rank: int) -> set[tuple[int, int]]:
    """(step, attempt) of every commit record in rank ``rank``'s local tier."""
    out = set()
    for p in (base / "local" / f"rank-{rank}" / "run" / "commits").glob("*.json"):
        step, attempt = p.stem.split("-")[1].split(".")
        out.add((int(step), int(attempt)))
    return out


def test_every_rank_gets_one_answer_the_same_ref_or_the_same_error(tmp_path: Path) -> None:
    # step 2: rank 1's local commit of its part fails (disk full) after rank 0 committed its own
    fault = {"rank": 1, "step": 2, "point": "member_before_part_commit", "action": "raise"}
    res = job(tmp_path, steps=[1, 2], fault=fault, close_flush=1)
    one = [r.results["save1"] for r in res]
    assert all(s["ok"] for s in one) and len({(s["save_id"], s["digest"]) for s in one}) == 1  # the same SaveRef
    two = [r.results["save2"] for r in res]
    assert [s["type"] for s in two] == ["CommitUnknownError"] * 2
    assert two[0]["message"] == two[1]["message"]  # the same error on every rank
    msg = two[0]["message"]
    assert "rank(s) 1 did not commit" in msg and "No space left on device" in msg
    assert "not acknowledged" in msg and "will not be resumed from the local tiers" in msg
    # nothing committed was deleted: rank 0's local commit of step 2 stays as evidence, rank 1 has none
    assert local_commits(tmp_path, 0) == {(1, 1), (2, 1)} and local_commits(tmp_path, 1) == {(1, 1)}
    with durable(tmp_path) as s:
        latest = s.latest_complete()
        assert latest is not None and latest.step == 1  # rank 1's part was never uploaded


def test_a_member_killed_before_its_part_commit_the_save_is_not_acknowledged(tmp_path: Path) -> None:
    # step 1 durable, step 2 in both local tiers only (replicate_every=2); rank 1 is killed at step 3
    # after rank 0 committed its part (it sent the record) and before rank 1 committed its own
    fault = {"rank": 1, "step": 3, "point": "member_before_part_commit"}
    res = job(tmp_path, steps=[1, 2, 3], every=2, fault=fault, timeout=10, close_flush=1)
    assert res[1].killed and not res[0].killed
    assert all(r.results[f"save{s}"]["ok"] for r in res for s in (1, 2))
    out = res[0].results["save3"]
    assert out["type"] == "CommitUnknownError", out  # rank 0's save() did not return: not acknowledged
    assert "rank(s) 1 did not commit" in out["message"] and "not acknowledged" in out["message"]
    held = [local_commits(tmp_path, r) for r in (0, 1)]  # (each keeps local_keep=2 commits)
    assert (3, 1) in held[0] and (3, 1) not in held[1] and (2, 1) in held[0] & held[1]
    # a restart of both ranks in fresh processes resumes from the save every rank holds, read bit for bit
    res = job(tmp_path, steps=[3], flush=20)
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)
    d = resume_tier(tmp_path)
    assert d["step"] == 2 and any("step 3: rank(s) [1]" in r for r in d["local_reasons"])
    # the unacknowledged commit of attempt 1 (superseded now) went with the local tier's retention
    assert (3, 1) not in local_commits(tmp_path, 0) and (3, 2) in local_commits(tmp_path, 0)
    with durable(tmp_path) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and (latest.step, latest.attempt) == (3, 2)


def test_signed_records_on_every_rank_and_both_tiers_resume_from_the_local_tiers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # many ranks x two tiers x auth_policy="require" (docs/combinations.md): every rank's local commit and
    # the durable one are tagged; a restart requires the tags and resumes from the local tiers, bit for bit
    import json
    import os
    import secrets

    from ckptstore import AuthOptions, OpenOptions, keyring_from_file
    from ckptstore.protocol import CommitRecord

    monkeypatch.delenv("CKPTSTORE_AUTH_KEYS", raising=False)
    kf = tmp_path / "keys.json"
    kf.write_text(json.dumps({"active": "k1", "keys": {"k1": secrets.token_hex(32)}}))
    os.chmod(kf, 0o600)
    first = job(tmp_path, steps=[1, 2], every=2, flush=20, key_file=str(kf))
    assert all(r.results["save1"]["ok"] and r.results["save2"]["ok"] for r in first), [r.results for r in first]
    ring = keyring_from_file(str(kf))
    with CheckpointStore.open(str(tmp_path / "durable"), "run", mode="r",
                              options=OpenOptions(auth=AuthOptions("require", ring))) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 1 and latest.record.auth is not None
        assert all(a.auth is not None for a in s.attempts())
    records = []
    for r in (0, 1):  # each node's local commit of step 2: the coordinator's record bytes, tagged
        files = [p for p in (tmp_path / "local" / f"rank-{r}" / "run" / "commits").iterdir() if p.suffix == ".json"]
        (data,) = [d for d in (p.read_bytes() for p in files) if CommitRecord.decode(d, "a local commit").step == 2]
        records.append(data)
    assert records[0] == records[1]
    rec = CommitRecord.decode(records[0], "rank 0's local commit of step 2")
    assert rec.step == 2 and rec.auth is not None and rec.auth.key_id == "k1"
    res = job(tmp_path, steps=[], flush=20, key_file=str(kf))
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)
    with CheckpointStore.open(str(tmp_path / "durable"), "run", mode="r",
                              options=OpenOptions(auth=AuthOptions("require", ring))) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 2 and latest.record.auth is not None  # replicated, tagged
    # a job that requires the tags but holds another key is refused on every rank, before anything runs
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"active": "k1", "keys": {"k1": secrets.token_hex(32)}}))
    os.chmod(other, 0o600)
    refused = run_job(2, str(tmp_path / "durable"), "tiers", args={"local": str(tmp_path / "local"),
                      "key_file": str(other), "steps": []}, worker=WORKER, timeout=90)
    assert all(not r.results["open"]["ok"] for r in refused), [r.results for r in refused]
