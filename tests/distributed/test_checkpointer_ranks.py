"""The Checkpointer on many ranks, as users run it: retention and the
corrupt-resume-point fallback decided by the coordinator for all ranks, a data
position per rank that DistributedSampler users can keep, and one refusal of a
world-size change on every rank.

Multi-rank tests start real processes (gloo on 127.0.0.1, tests/workers/rank_worker.py):
DDP over a tiny model, SGD with momentum, a sharded ResumableLoader, per-rank
RNG, the Checkpointer's defaults (asynchronous saves, signal handling). Every
resumed rank is compared bit for bit with an uninterrupted run."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ckptstore import CheckpointStore, InvalidInputError, SaveState
from ckptstore import protocol as P
from ckptstore.backends.schemes import backend_from_url
from ckptstore.protocol.selection import SaveRef
from ckptstore.torch import Checkpointer, ResumableLoader, ResumableSampler
from tests.conftest import selected_kinds
from tests.helpers import RawAccess
from tests.incremental.common import stored_at
from tests.workers.dist_launch import RankResult, run_job

WORKER = str(Path(__file__).parents[1] / "workers" / "rank_worker.py")
STOP = 10  # the uninterrupted run's length (saves after steps 1, 3, 5, 7, 9)
#: test_retention_on_two_ranks_keeps_the_two_newest_saves sees what retention left by version 2's save
#: folders (version 3 keeps them empty: its pieces' retention, tests/store/test_incremental_retention.py)
SAVE_FOLDERS_VERSION = 2


def job(world: int, url: str, opts: dict[str, Any] | None = None, **args: Any) -> list[RankResult]:
    return run_job(world, url, "train", opts=opts, args=args, worker=WORKER, timeout=180)


def results(res: list[RankResult], event: str) -> list[dict[str, Any]]:
    got = [r.results.get(event) for r in res]
    assert all(g is not None for g in got), [(r.rank, r.returncode, r.stderr[-2000:]) for r in res]
    return got  # type: ignore[return-value]


def trained(res: list[RankResult]) -> list[dict[str, Any]]:
    out = results(res, "ckpt")
    assert all(o["ok"] for o in out), out
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return trained(job(2, str(tmp_path_factory.mktemp("reference") / "store"), stop=STOP))


def assert_continues_exactly(resumed: list[dict[str, Any]], full: list[dict[str, Any]], start: int) -> None:
    for r, (a, b) in enumerate(zip(full, resumed, strict=True)):
        assert b["start"] == start, (r, b["start"])
        # this rank's batches (its DistributedSampler shard), its RNG draws and the weights, bit for bit
        assert b["steps"] == {k: v for k, v in a["steps"].items() if int(k) >= start}, r
        assert b["weights"] == a["weights"], r


def where(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if kind not in selected_kinds():
        pytest.skip(f"{kind} is not among CKPT_BACKENDS")
    if kind == "local":
        return str(tmp_path / "store"), {}
    return request.getfixturevalue("object_servers").url_and_options(kind, f"ranks-{uuid.uuid4().hex[:8]}")  # type: ignore[no-any-return]


def committed_steps(url: str, opts: dict[str, Any]) -> list[int]:
    st = CheckpointStore.open(url, "run", mode="r", storage_options=opts or None)
    return sorted(i.step for i in st.list_saves(grace_seconds=0) if i.state is SaveState.COMMITTED)


def saved_ids(url: str, opts: dict[str, Any]) -> set[str]:
    """Save IDs with any object left under saves/ (committed or not)."""
    st = CheckpointStore.open(url, "run", mode="r", storage_options=opts or None)
    prefix = P.saves_prefix("run")
    return {o.key[len(prefix):].split("/", 1)[0] for o in st.backend.list(prefix)}


def flip(url: str, ref: SaveRef, name: str) -> None:
    """One bit of a stored component (its file; on version 3 its piece), written straight to the storage."""
    key, at = stored_at("run", ref, name, -3)  # in the last tensor's bytes
    raw = RawAccess(backend_from_url(url))
    data = bytearray(raw.get(key) or b"")
    assert data
    data[at] ^= 0x01
    raw.set(key, bytes(data))


# ------------------------------------------------------------------ many ranks


@pytest.mark.parametrize("kind", ["local", "moto"])
def test_retention_on_two_ranks_keeps_the_two_newest_saves(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, uninterrupted: list[dict[str, Any]]
) -> None:
    url, opts = where(kind, tmp_path, request)
    first = trained(job(2, url, opts, stop=7, keep_last=2, protocol_version=SAVE_FOLDERS_VERSION))  # saves 1, 3, 5
    assert all(not o["retention_errors"] and not o["warnings"] for o in first), first
    assert committed_steps(url, opts) == [3, 5]
    st = CheckpointStore.open(url, "run", mode="r", storage_options=opts or None)
    kept = {st.get_save(s).save_id for s in (3, 5)}
    assert saved_ids(url, opts) == kept  # every rank's part of step 1 is gone, nothing else
    second = trained(job(2, url, opts, stop=STOP, keep_last=2))  # resumes 5, saves 7, 9
    assert_continues_exactly(second, uninterrupted, 6)
    assert committed_steps(url, opts) == [7, 9]
    ref = CheckpointStore.open(url, "run", mode="r", storage_options=opts or None).latest_complete(deep=True)
    assert ref is not None and ref.step == 9
    assert sorted(ref.record.ranks or {}) == [0, 1]


def test_corrupt_part_on_rank1_falls_back_on_every_rank(
    tmp_path: Path, uninterrupted: list[dict[str, Any]]
) -> None:
    url = str(tmp_path / "store")
    trained(job(2, url, stop=5))  # saves 1, 3
    bad = CheckpointStore.open(url, "run", mode="r").get_save(3)
    # rank 1's own bytes: under DDP both ranks' model and optimizer bytes are equal, and a version-3 run
    # stores them once (one piece two parts name); the random streams differ per rank
    flip(url, bad, "rank1/rng.safetensors")  # same size: the cheap selection picks step 3

    resumed = trained(job(2, url, stop=STOP, resume_verify="cheap"))
    # both ranks moved to the same older save, in the same new attempt, and continue exactly
    assert_continues_exactly(resumed, uninterrupted, 2)
    assert [o["attempt"] for o in resumed] == [3, 3]  # 1: first job, 2: this job's open, 3: the fallback
    assert [o["resumed"] for o in resumed] == [1, 1]
    for o in resumed:
        assert any("every rank resumes from step 1" in w and "rank 1: step 3" in w for w in o["warnings"]), o
    ev = [e for e in CheckpointStore.open(url, "run", mode="r").events() if e["event"] == "resume-fallback"]
    assert len(ev) == 1
    pay = ev[0]["payload"]
    assert (pay["from_step"], pay["to_step"], pay["attempt"]) == (3, 1, 3)
    assert len(pay["reasons"]) == 1 and pay["reasons"][0].startswith("rank 1: step 3")
    assert "rank1/rng.safetensors" in pay["reasons"][0]
    # the corrupt save left the run's history: the newest complete save is the resumed job's
    latest = CheckpointStore.open(url, "run", mode="r").latest_complete(deep=True)
    assert latest is not None and latest.step == STOP - 1 and latest.attempt == 3


def test_no_intact_save_left_is_the_same_error_on_every_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trained(job(2, url, stop=2))  # one save (step 1)
    ref = CheckpointStore.open(url, "run", mode="r").get_save(1)
    flip(url, ref, "rank1/optimizer.safetensors")
    outs = results(job(2, url, stop=4, resume_verify="cheap"), "ckpt")
    assert [o.get("type") for o in outs] == ["CorruptionError"] * 2, outs
    assert outs[0]["message"] == outs[1]["message"]
    assert "no complete save could be read back intact on every rank" in outs[0]["message"]
    assert "rank 1: step 1" in outs[0]["message"]
    events = [e["event"] for e in CheckpointStore.open(url, "run", mode="r").events()]
    assert "resume-fallback" not in events and "resume" not in events


def test_world_size_change_refused_the_same_on_every_rank(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    trained(job(2, url, stop=2))  # one save (step 1) by 2 ranks
    # (first, on the same world size: a misfit on one rank is refused on every rank, before anything is loaded)
    outs = results(job(2, url, stop=4, adam_on_rank=1), "ckpt")
    assert [o.get("type") for o in outs] == ["RemoteError", "CheckpointMismatchError"], outs
    assert "saved by a torch.optim.sgd.SGD" in outs[1]["message"]
    assert outs[0]["message"] == "CheckpointMismatchError: rank 1: " + outs[1]["message"]
    # the identity names the world size: one refusal that names the way out
    opens = results(job(3, url, stop=4), "open")
    assert [o["type"] for o in opens] == ["IdentityMismatchError"] * 3
    assert len({o["message"] for o in opens}) == 1
    msg = opens[0]["message"]
    assert "world_size: stored 2, requested 3" in msg and "reshard=True" in msg and "DCP reader" in msg
    assert "open a new run ID" not in msg
    # reshard=True: opened, but the per-rank Checkpointer refuses before anything is loaded, alike on every rank
    res = job(3, url, stop=4, reshard=True)
    assert all(o["ok"] and o["resharded"]["from_world_size"] == 2 for o in results(res, "open"))
    outs = results(res, "ckpt")
    assert [o["type"] for o in outs] == ["WorldSizeMismatchError"] * 3
    assert len({o["message"] for o in outs}) == 1
    msg = outs[0]["message"]
    assert "reshard=True" in msg and "step 1 was written by 2 ranks, this job has 3" in msg
    assert "DCP reader" in msg and "cannot reshard" in msg
    events = [e["event"] for e in CheckpointStore.open(url, "run", mode="r").events()]
    assert "reshard" in events and events.count("resume") == 0 and events.count("start") == 1
    assert "resume-fallback" not in events


# ------------------------------------------------------------------ the sharded position, one process


@pytest.mark.parametrize("n", [10, 11, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_sampler_partitions_like_distributed_sampler(n: int, world: int, shuffle: bool, drop_last: bool) -> None:
    data = list(range(n))
    for rank in range(world):
        if drop_last and n < world:
            with pytest.raises(InvalidInputError, match="cannot be sharded"):
                ResumableSampler(n, seed=3, shuffle=shuffle, num_replicas=world, rank=rank, drop_last=drop_last)
            continue
        ours = ResumableSampler(n, seed=3, shuffle=shuffle, num_replicas=world, rank=rank, drop_last=drop_last)
        theirs = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)  # the epoch advances by itself
            assert ours.length == len(theirs)


def test_sharded_sampler_resumes_exactly_per_rank() -> None:
    for rank in range(3):
        full = ResumableSampler(20, seed=1, num_replicas=3, rank=rank)
        expect = [i for _ in range(2) for i in full]
        s = ResumableSampler(20, seed=1, num_replicas=3, rank=rank)
        it = iter(s)
        head = [next(it) for _ in range(4)]
        state = s.state_dict()
        assert (state["num_replicas"], state["rank"], state["offset"]) == (3, rank, 4)
        s2 = ResumableSampler(20, seed=1, num_replicas=3, rank=rank)
        s2.load_state_dict(state)
        assert head + list(s2) + list(s2) == expect
    other = ResumableSampler(20, seed=1, num_replicas=3, rank=0)
    with pytest.raises(InvalidInputError, match="saved by rank 2, this sampler is rank 0"):
        other.load_state_dict(state)


def test_world_size_change_carries_the_global_position_or_refuses() -> None:
    n = 24
    order = ResumableSampler(n, seed=9).order(0)  # the epoch's order on one rank: every position
    old = [ResumableSampler(n, seed=9, num_replicas=2, rank=r) for r in range(2)]
    consumed = []
    for s in old:
        it = iter(s)
        consumed += [next(it) for _ in range(3)]  # 6 of the epoch's positions, on 2 ranks
    assert sorted(consumed) == sorted(order[:6])
    rest = []
    for r in range(3):
        new = ResumableSampler(n, seed=9, num_replicas=3, rank=r)
        new.load_state_dict(old[r % 2].state_dict())
        assert new.offset == 2  # 6 consumed / 3 ranks
        rest += list(new)
    assert sorted(consumed + rest) == list(range(n))  # nothing repeated, nothing skipped
    # 2 ranks x 1 sample does not split over 3 ranks: refused, never rounded
    s = ResumableSampler(n, seed=9, num_replicas=2, rank=0)
    next(iter(s))
    with pytest.raises(InvalidInputError, match="cannot carry over exactly"):
        ResumableSampler(n, seed=9, num_replicas=3, rank=0).load_state_dict(s.state_dict())
    # a finished epoch stays finished
    done = ResumableSampler(n, seed=9, num_replicas=2, rank=1)
    list(done)
    one = ResumableSampler(n, seed=9)
    one.load_state_dict(done.state_dict() | {"offset": done.length, "epoch": 0})
    assert one.offset == n and list(one) == ResumableSampler(n, seed=9).order(1)


def test_sharded_loader_carries_whole_batches_over_a_world_size_change() -> None:
    ds = [torch.tensor(i) for i in range(24)]
    old = [ResumableLoader(ds, batch_size=2, seed=4, seed_samples=False, num_replicas=2, rank=r) for r in range(2)]
    seen: list[int] = []
    for ld in old:
        it = iter(ld)
        for _ in range(3):  # 3 batches of 2 on each of 2 ranks: 12 samples, 2 whole batches on each of 3
            seen += next(it).tolist()
    rest: list[int] = []
    for r in range(3):
        new = ResumableLoader(ds, batch_size=2, seed=4, seed_samples=False, num_replicas=3, rank=r)
        new.load_state_dict(old[r % 2].state_dict())
        assert new.batches == 2
        for b in new:
            rest += b.tolist()
    assert sorted(seen + rest) == list(range(24))
    odd = ResumableLoader(ds, batch_size=2, seed=4, seed_samples=False, num_replicas=2, rank=0)
    next(iter(odd))  # 4 samples consumed in all: not whole batches over 3 ranks
    with pytest.raises(InvalidInputError, match="cannot carry over exactly"):
        ResumableLoader(ds, batch_size=2, seed=4, seed_samples=False, num_replicas=3, rank=0).load_state_dict(
            odd.state_dict())


def test_distributed_sampler_refused_with_the_fix(tmp_path: Path) -> None:
    ds = list(range(8))
    ident = {"data_digest": "d", "code_digest": "c"}
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, seed=1)
    for obj in (sampler, DataLoader(ds, sampler=sampler)):
        st = CheckpointStore.open(str(tmp_path / "s"), "run", identity=ident)
        with pytest.raises(InvalidInputError) as e:
            Checkpointer(st, {"data": obj}, handle_signals=False)
        msg = str(e.value)
        assert "DistributedSampler" in msg and "no state_dict()" in msg
        assert "ResumableSampler(len(dataset), num_replicas=world_size, rank=rank" in msg
        assert "ResumableLoader(" in msg and "without pickle" not in msg
