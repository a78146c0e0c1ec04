"""Two tiers on many ranks with a protocol version 3 run (pieces), with real
processes (gloo, world size 2) on a local-directory durable tier: each rank
writes its part as pieces in its own local tier (``<local>/rank-<r>``) and
uploads only the pieces of its part the durable tier lacks.

A base job saves step 1 (replicated: durable) and step 2 (``replicate_every=2``:
committed in both local tiers only); each rank's ``frozen`` component is the
same at both steps. Each test restarts from a copy of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.errors import NotFoundError
from tests.workers.dist_launch import RankResult, run_job

pytest.importorskip("torch.distributed")

WORKER = str(Path(__file__).parents[1] / "workers" / "tier_rank_worker.py")


def job(base: Path, **args: object) -> list[RankResult]:
    res = run_job(2, str(base / "durable"), "tiers", args={"local": str(base / "local"), "protocol_version": 3,
                                                           **args}, worker=WORKER, timeout=90)
    for r in res:
        if r.killed:
            continue
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.results.get("open", {}).get("ok"), (r.results, r.stderr[-3000:])
    return res


def durable(base: Path) -> CheckpointStore:
    return CheckpointStore.open(str(base / "durable"), "run")


def piece_bytes(run_dir: Path, save_id: str) -> int:
    """Bytes of the pieces held under ``save_id`` (those that save wrote itself)."""
    return sum(p.stat().st_size for p in (run_dir / "pieces" / save_id).glob("*") if p.is_file())


@pytest.fixture(scope="module")
def base_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RankResult]]:
    base = tmp_path_factory.mktemp("base3")
    res = job(base, steps=[1, 2], every=2, flush=20)
    for r in res:
        assert r.results["save1"]["ok"] and r.results["save2"]["ok"], r.results
        assert r.results["flush"]["ok"], r.results
    return base, res


@pytest.fixture
def restart(base_job: tuple[Path, list[RankResult]], tmp_path: Path) -> Path:
    shutil.copytree(base_job[0], tmp_path / "job")
    return tmp_path / "job"


def opened(res: list[RankResult]) -> list[tuple[int | None, str | None]]:
    return [(r.results["open"]["resumed"], r.results["open"]["tier"]) for r in res]


def test_each_rank_writes_its_part_as_pieces_and_the_second_save_reuses_the_frozen_part(
        base_job: tuple[Path, list[RankResult]]) -> None:
    base, res = base_job
    sid1, sid2 = res[0].results["save1"]["save_id"], res[0].results["save2"]["save_id"]
    assert [r.results["save2"]["digest"] for r in res][0] == res[1].results["save2"]["digest"]  # one record
    for r in (0, 1):
        run_dir = base / "local" / f"rank-{r}" / "run"
        assert not list((run_dir / "saves").rglob("*/model"))  # no whole components: pieces only
        first, second = piece_bytes(run_dir, sid1), piece_bytes(run_dir, sid2)
        assert first > 1_500_000 > second > 0  # step 2 wrote model and extra, reused the frozen pieces
    with durable(base) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 1  # step 2 is in the local tiers only
        assert s.verify(latest, deep=True).ok
        assert sorted(latest.record.ranks or {}) == [0, 1]
        assert all(c.pieces is not None for c in latest.components.values())
        for name in ("rank0/frozen", "rank1/frozen", "rank0/model", "rank1/model"):
            assert len(s.read(latest, name)) > 0  # every rank's part reached the durable tier


def test_both_nodes_intact_resume_from_the_local_tiers_and_replicate_only_lacking_pieces(restart: Path) -> None:
    res = job(restart, steps=[], flush=20)
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)  # each rank's part, verified, from its own disk
    with durable(restart) as s:  # the resumed local-only save was replicated, both parts, then committed
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 2
        assert s.verify(latest, deep=True).ok
        older = s.get_save(1, latest.attempt)
        run_dir = restart / "durable" / "run"
        # the frozen pieces were already durable (under step 1's save): not uploaded again
        assert piece_bytes(run_dir, older.save_id) > 2 * 1_500_000 > piece_bytes(run_dir, latest.save_id) > 0


def test_one_node_lost_every_rank_reads_the_durable_copy(restart: Path) -> None:
    shutil.rmtree(restart / "local" / "rank-1")  # node 1 was replaced: its disk is empty
    res = job(restart, steps=[3], flush=20)
    assert opened(res) == [(1, "durable"), (1, "durable")]  # all ranks or none
    assert all(r.results["read"]["ok"] for r in res)  # bit for bit, from the durable tier
    assert all(r.results["save3"]["ok"] for r in res), [r.results for r in res]
    with durable(restart) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 3  # training went on and replicated
        assert s.verify(latest, deep=True).ok
        for r in (0, 1):
            assert len(s.read(latest, f"rank{r}/frozen")) == 1_500_000


def test_a_rank_killed_before_uploading_its_pieces_leaves_no_durable_commit_and_the_restart_catches_up(
        tmp_path: Path) -> None:
    # rank 1 is killed as its replicator starts uploading its part of step 2 (its save() returned on every rank)
    res = job(tmp_path, steps=[1, 2], flush=2.5, close_flush=1, kill={"rank": 1, "step": 2})
    assert res[1].killed and not res[0].killed
    assert res[0].results["save2"]["ok"]  # committed in both local tiers
    assert not res[0].results["flush"]["ok"]  # ... but never made durable: rank 1's pieces are missing
    with durable(tmp_path) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 1  # the previous durable save stays selected
        with pytest.raises(NotFoundError):
            s.get_save(2)
    res = job(tmp_path, steps=[], flush=20)  # the restart resumes locally, reads bit for bit, catches up
    assert opened(res) == [(2, "local"), (2, "local")]
    assert all(r.results["read"]["ok"] for r in res)
    with durable(tmp_path) as s:
        latest = s.latest_complete(deep=True)
        assert latest is not None and latest.step == 2 and s.verify(latest, deep=True).ok
