"""Invariant 7 with real processes: a job opens a run once, and a save is
published for all ranks or none. Ranks are separate processes on gloo over
127.0.0.1; faults are real SIGKILLs at each point of a save."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore
from ckptstore import protocol as P
from tests.conftest import selected_kinds
from tests.workers.dist_launch import RankResult, run_job

pytestmark = pytest.mark.backends("local", "moto", "fakegcs")
#: test_fault_at_each_point finds what each rank left of a failed save by component name, in version 2's
#: whole-component files (version 3's pieces are nameless)
COMPONENT_FILES_VERSION = 2


def where(backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if backend_kind == "local":
        return str(tmp_path / "store"), {}
    servers = request.getfixturevalue("object_servers")
    url, opts = servers.url_and_options(backend_kind, f"dist-{uuid.uuid4().hex[:8]}")
    return url, opts


def reader(url: str, opts: dict[str, Any]) -> CheckpointStore:
    return CheckpointStore.open(url, "run", mode="r", storage_options=opts or None)


def components_of(store: CheckpointStore, step: int) -> set[str]:
    """Component names present under every save ID of ``step`` (committed or not)."""
    prefix = P.saves_prefix(store.run_id)
    out = set()
    for o in store.backend.list(prefix):
        sid, name = o.key[len(prefix):].split("/", 1)
        sa = P.parse_save_id(sid)
        if sa is not None and sa[0] == step:
            out.add(name)
    return out


def ok(res: list[RankResult], event: str) -> list[dict[str, Any]]:
    got = [r.results.get(event) for r in res]
    assert all(g is not None for g in got), [(r.rank, r.returncode, r.stderr[-1500:]) for r in res]
    return got  # type: ignore[return-value]


@pytest.mark.backends("local")
def test_one_attempt_per_job_and_one_save_for_all_ranks(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(backend_kind, tmp_path, request)
    res = run_job(2, url, "saves", opts=opts, args={"steps": [1, 2]})
    opens = ok(res, "open")
    assert [o["attempt"] for o in opens] == [1, 1]
    for step in (1, 2):
        saves = ok(res, f"save{step}")
        assert all(s["ok"] for s in saves)
        assert len({s["digest"] for s in saves}) == 1  # every rank holds the same reference
    store = reader(url, opts)
    assert [a.number for a in store.attempts()] == [1]
    ref = store.latest_complete(deep=True)
    assert ref is not None and ref.step == 2
    assert sorted(ref.components) == ["rank0/extra", "rank0/model", "rank1/extra", "rank1/model"]
    assert ref.record.ranks is not None
    assert {k: sorted(v) for k, v in ref.record.ranks.items()} == {
        0: ["rank0/extra", "rank0/model"], 1: ["rank1/extra", "rank1/model"]
    }
    assert ref.record.world_size == 2
    # a restarted job resumes from it on every rank, and each rank reads its own bytes back
    res = run_job(2, url, "saves", opts=opts, args={"steps": [3]})
    opens = ok(res, "open")
    assert [(o["attempt"], o["resumed"]) for o in opens] == [(2, 2), (2, 2)]
    assert all(r["ok"] for r in ok(res, "read"))


# (rank, point) -> what happens
FAULTS = [
    (1, "before_write"), (1, "during_write"), (1, "after_write"), (1, "raise"),
    (0, "raise"), (0, "during_write"), (0, "before_gather"), (0, "before_publish"), (0, "after_publish"),
]
OBJECT_FAULTS = [(1, "during_write"), (1, "raise"), (0, "before_publish"), (0, "after_publish")]


def fault_cases() -> list[Any]:
    out = []
    for kind in ("local", "moto", "fakegcs"):
        for rank, point in FAULTS if kind == "local" else OBJECT_FAULTS:
            out.append(pytest.param(kind, rank, point, id=f"{kind}-rank{rank}-{point}"))
    return out


@pytest.mark.parametrize(("kind", "rank", "point"), fault_cases())
def test_fault_at_each_point(kind: str, rank: int, point: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    if kind not in selected_kinds():
        pytest.skip(f"{kind} is not among CKPT_BACKENDS")
    url, opts = where(kind, tmp_path, request)
    killed = point not in ("raise",)
    fault: dict[str, Any] = {"rank": rank, "point": point}
    if killed and rank == 1:
        # the coordinator waits for the dead member's inventory until the save's
        # deadline; nothing else is waited for in this save, so a short deadline
        # proves the same ("rank(s) 1 did not answer", nothing published)
        fault["save_timeout"] = 4
    res = run_job(2, url, "saves", opts=opts, args={"steps": [1, 2], "faults": {"2": fault}, "save_timeout": 15,
                                                    "protocol_version": COMPONENT_FILES_VERSION})
    assert all(s["ok"] for s in ok(res, "save1"))
    victim, survivor = res[rank], res[1 - rank]
    if killed:
        assert victim.killed, victim.stderr[-2000:]
    out = survivor.results["save2"]
    store = reader(url, opts)
    latest = store.latest_complete(deep=True)
    assert latest is not None
    if point == "raise":
        both = ok(res, "save2")
        assert [b["type"] for b in both] == ["SaveAbortedError", "SaveAbortedError"]
        assert both[0]["message"] == both[1]["message"]  # the same error on every rank
        assert f"rank(s) {rank} failed" in out["message"] and "failed on purpose" in out["message"]
        assert latest.step == 1
        assert components_of(store, 2) == set()  # every rank removed what it wrote
    elif rank == 1:
        # a member died: the coordinator names it, publishes nothing
        assert out["type"] == "SaveAbortedError", out
        assert "rank(s) 1 did not answer" in out["message"]
        assert latest.step == 1
    elif point == "after_publish":
        # the coordinator died after the commit: the save is published; the
        # survivor cannot tell and says so, deleting nothing
        assert out["type"] == "CommitUnknownError", out
        assert latest.step == 2
        assert sorted(latest.components) == ["rank0/extra", "rank0/model", "rank1/extra", "rank1/model"]
    elif point == "during_write" and out["type"] == "SaveAbortedError":
        # the coordinator died writing its part before the member read the save ID from the
        # rendezvous store (rank 0 hosts it; a busy machine schedules the member late): the
        # member never started the save, says so, and holds nothing of it
        assert "the coordinator (rank 0) did not start it" in out["message"], out
        assert latest.step == 1
        assert not {c for c in components_of(store, 2) if c.startswith("rank1/")}
    else:
        # the coordinator died before the commit: nothing published, the survivor
        # cannot tell whether a commit landed, so it keeps its components
        assert out["type"] == "CommitUnknownError", out
        assert "rank 0 (the coordinator)" in out["message"]
        assert latest.step == 1
        assert {"rank1/model", "rank1/extra"} <= components_of(store, 2)
    sel = store.latest_complete(explain=True)
    assert sel.latest is not None and sel.latest.step == latest.step


@pytest.mark.backends("local")
def test_world_size_checked_on_every_rank(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(backend_kind, tmp_path, request)
    ident = {"data_digest": "d", "code_digest": "c", "world_size": 3}
    res = run_job(2, url, "saves", opts=opts, args={"identity": ident, "steps": []})
    opens = ok(res, "open")
    assert [o["type"] for o in opens] == ["WorldSizeMismatchError"] * 2
    assert "world_size=3" in opens[0]["message"] and opens[0]["message"] == opens[1]["message"]
    assert not (tmp_path / "store" / "run").exists()  # refused before anything was written


@pytest.mark.backends("local")
def test_changed_world_size_refused_unless_resharding(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(backend_kind, tmp_path, request)
    res = run_job(2, url, "saves", opts=opts, args={"steps": [1]})
    assert all(s["ok"] for s in ok(res, "save1"))
    # same job at 3 ranks: the identity (world_size=3) does not match the bound one
    res = run_job(3, url, "saves", opts=opts, args={"steps": []})
    opens = ok(res, "open")
    assert [o["type"] for o in opens] == ["IdentityMismatchError"] * 3
    assert "world_size: stored 2, requested 3" in opens[2]["message"]
    # an identity without world_size is compared with the save's recorded world size
    ident = {"data_digest": "d2", "code_digest": "c"}
    res = run_job(2, url + "-b", "saves", opts=opts, args={"identity": ident, "steps": [1]})
    assert all(s["ok"] for s in ok(res, "save1"))
    res = run_job(3, url + "-b", "saves", opts=opts, args={"identity": ident, "steps": []})
    assert [o["type"] for o in ok(res, "open")] == ["WorldSizeMismatchError"] * 3
    # asked for explicitly: continued, and recorded in the ledger
    res = run_job(3, url, "saves", opts=opts, args={"steps": [], "reshard": True})
    opens = ok(res, "open")
    assert all(o["ok"] for o in opens)
    assert opens[0]["resharded"] == {"from_world_size": 2, "to_world_size": 3, "resumed_from": 1}
    events = [e for e in reader(url, opts).events() if e["event"] == "reshard"]
    assert len(events) == 1 and events[0]["payload"]["to_world_size"] == 3


@pytest.mark.backends("local")
def test_ranks_with_different_identities_refused(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(backend_kind, tmp_path, request)
    res = run_job(2, url, "mixed_identity", opts=opts)
    opens = ok(res, "open")
    assert [o["type"] for o in opens] == ["InvalidInputError"] * 2
    assert "rank(s) 1 opened it with another identity" in opens[0]["message"]


@pytest.mark.backends("local")
def test_four_ranks_publish_one_save_of_every_rank(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(backend_kind, tmp_path, request)
    res = run_job(4, url, "saves", opts=opts, args={"steps": [5], "faults": {}})
    assert len({s["digest"] for s in ok(res, "save5")}) == 1
    ref = reader(url, opts).latest_complete(deep=True)
    assert ref is not None and len(ref.components) == 8


@pytest.mark.backends("local")
def test_checkpointer_on_two_ranks_resumes_exactly(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    url, opts = where(backend_kind, tmp_path, request)
    ref_url = str(tmp_path / "reference")
    full = run_job(2, ref_url, "checkpointer", args={"stop": 8})  # uninterrupted
    first = run_job(2, url, "checkpointer", args={"stop": 5})  # saves after steps 1 and 3, stops
    second = run_job(2, url, "checkpointer", args={"stop": 8})  # resumes at step 4
    for r in (0, 1):
        a, b, c = full[r].results["ckpt"], first[r].results["ckpt"], second[r].results["ckpt"]
        assert b["start"] == 0 and c["start"] == 4, (b, c)
        # every rank continues its own RNG streams and data position exactly
        assert {k: v for k, v in a["draws"].items() if int(k) >= 4} == c["draws"]
    ref = reader(url, opts).latest_complete(deep=True)
    assert ref is not None and ref.step == 7
    assert ref.record.ranks is not None and set(ref.record.ranks) == {0, 1}
    assert all(n.startswith(f"rank{r}/") for r, names in ref.record.ranks.items() for n in names)


@pytest.mark.backends("local")
def test_one_job_opens_the_same_run_id_in_two_stores(backend_kind: str, tmp_path: Path, request) -> None:  # type: ignore[no-untyped-def]
    # regression: the two opens' messages once shared keys, and the second store's
    # members tried to join the first store's attempt
    url, opts = where(backend_kind, tmp_path, request)
    res = run_job(2, url, "saves", opts=opts, args={"steps": [1]})  # the first store already has attempt 1
    res = run_job(2, url, "two_places", opts=opts)
    assert [o["attempt"] for o in ok(res, "open")] == [2, 2]
    assert [o["attempt"] for o in ok(res, "other")] == [1, 1]
    assert all(s["ok"] for s in ok(res, "save1") + ok(res, "save1b"))
    assert reader(url + "-b", opts).latest_complete(deep=True) is not None


def test_member_refuses_to_join_a_superseded_attempt(backend) -> None:  # type: ignore[no-untyped-def]
    """A member of an older job (or of an earlier generation of restarted
    workers) must not join its attempt once a newer attempt was registered."""
    from ckptstore import SupersededError

    ident = {"data_digest": "d", "code_digest": "c"}
    CheckpointStore.open(backend, "run", identity=ident, single_writer=True)  # attempt 1
    newer = CheckpointStore.open(backend, "run", identity=ident, single_writer=True)  # attempt 2 fences it
    assert newer.attempt is not None and newer.attempt.number == 2
    with pytest.raises(SupersededError, match="cannot join attempt 1: attempt 2 restarted the run from scratch"):
        CheckpointStore.open(backend, "run", identity=ident, join_attempt=1)
    member = CheckpointStore.open(backend, "run", identity=ident, join_attempt=2)
    assert member.attempt == newer.attempt
