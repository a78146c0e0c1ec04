"""Two tiers on real parts: a local directory as the fast tier and a real
durable backend (local disk, SeaweedFS, moto, fake-gcs-server). Every test
asserts what a resume reads and what the durable tier holds."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore import CheckpointStore
from ckptstore.backends.base import Backend
from ckptstore.backends.faults import FaultyBackend, transient
from ckptstore.protocol import component_key
from ckptstore.protocol.layout import piece_key
from ckptstore.protocol.selection import SaveRef

IDENT = {"model": "tiny", "seed": 1}
backend_kinds = ("local", "seaweedfs", "moto", "fakegcs")
#: test_save_commits_locally_then_durably_with_the_same_manifest counts version 2's save folders in the
#: local tier (version 3 keeps them empty; its pieces in two tiers: tests/tiers/test_pieces.py)
SAVE_FOLDERS_VERSION = 2


def payload(step: int) -> bytes:
    return bytes((step * 7 + i) % 251 for i in range(3000))


def save(store: CheckpointStore, step: int) -> None:
    with store.save(step) as w:
        w.put("a", payload(step))
        w.put("b/c", payload(step)[::-1])


def open_tiered(durable: Backend, local: Path, **kw: object) -> CheckpointStore:
    return CheckpointStore.open(durable, "run", identity=IDENT, local_tier=local, **kw)  # type: ignore[arg-type]


def durable_steps(backend: Backend) -> list[int]:
    r = CheckpointStore.open(backend, "run", mode="r")
    return sorted(i.step for i in r.list_saves() if i.state.value == "committed")


def resume_event(store: CheckpointStore) -> dict[str, object]:
    return [e for e in store.events() if e["event"] == "resume-tier"][-1]["payload"]


def local_file(local: Path, ref: SaveRef, name: str) -> Path:
    """The local tier's file of ``name`` in ``ref``: its first piece on version 3, the whole component on 2."""
    pieces = ref.components[name].pieces
    if pieces:
        return local / piece_key("run", pieces[0].holder, pieces[0].digest)
    return local / component_key("run", ref.save_id, name)


def test_save_commits_locally_then_durably_with_the_same_manifest(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme", protocol_version=SAVE_FOLDERS_VERSION)
    for step in range(3):
        save(s, step)
    assert s.flush(30)
    st = s.replication_status()
    assert st is not None and st.lag == 0 and st.last_durable_step == 2 and st.failures == 0
    ref = s.latest_complete(deep=True)
    assert ref is not None and (ref.step, ref.tier) == (2, "both")
    r = CheckpointStore.open(backend_factory(), "run", mode="r")
    dref = r.latest_complete(deep=True)
    assert dref is not None and dref.manifest_digest == ref.manifest_digest and dref.tier == "durable"
    assert r.read(dref, "a") == payload(2)
    s.close()
    # the local tier keeps local_keep (2) saves; the durable tier keeps all
    assert durable_steps(backend_factory()) == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "nvme" / "run" / "saves").iterdir())[0].startswith("000000000001")


def test_resume_reads_the_local_copy_when_it_verifies(backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme")
    save(s, 5)
    assert s.flush(30)
    s.close()
    s2 = open_tiered(backend_factory(), tmp_path / "nvme")
    assert s2.resumed_from is not None and s2.resumed_from.tier == "both"
    assert s2.read(s2.resumed_from, "a") == payload(5)
    assert resume_event(s2)["tier"] == "local"
    s2.close()


@pytest.mark.parametrize("damage", ["bitflip", "missing", "truncated", "dir-removed"])
def test_a_damaged_local_copy_falls_back_to_the_durable_copy(
        backend_factory: Callable[[], Backend], tmp_path: Path, damage: str) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme")
    save(s, 1)
    save(s, 2)
    assert s.flush(30)
    newest = s.latest_complete()
    assert newest is not None
    sid = newest.save_id
    s.close()
    f = local_file(tmp_path / "nvme", newest, "a")
    if damage == "bitflip":
        b = bytearray(f.read_bytes())
        b[100] ^= 1
        f.write_bytes(bytes(b))
    elif damage == "missing":
        f.unlink()
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:-1])
    else:
        shutil.rmtree(tmp_path / "nvme")
    s2 = open_tiered(backend_factory(), tmp_path / "nvme")
    ref = s2.resumed_from
    assert ref is not None and ref.step == 2 and ref.tier == "durable" and ref.save_id == sid
    assert s2.read(ref, "a") == payload(2)
    ev = resume_event(s2)
    assert ev["tier"] == "durable" and ev["durable_newest_step"] == 2
    if damage != "dir-removed":
        assert ev["local_reasons"], ev
    s2.close()


def test_cheap_resume_of_a_corrupt_local_copy_reads_the_durable_bytes(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """resume_verify='cheap' (the one-pass restore) chooses the local copy by
    size; the verified read finds the flip and reads the durable copy instead."""
    s = open_tiered(backend_factory(), tmp_path / "nvme")
    save(s, 3)
    assert s.flush(30)
    newest = s.latest_complete()
    assert newest is not None
    s.close()
    f = local_file(tmp_path / "nvme", newest, "a")
    b = bytearray(f.read_bytes())
    b[7] ^= 0x10
    f.write_bytes(bytes(b))
    s2 = open_tiered(backend_factory(), tmp_path / "nvme", resume_verify="cheap")
    ref = s2.resumed_from
    assert ref is not None and ref.tier == "both"
    assert s2.read(ref, "a") == payload(3)
    out = bytearray(ref.components["a"].size)
    s2.read_into(ref, "a", out)
    assert bytes(out) == payload(3)
    s2.close()


def down_when(flag: threading.Event) -> Callable[[str, str], bool]:
    return lambda op, key: flag.is_set() and op in ("put", "create", "list", "size", "get")


def wait_for_failure(s: CheckpointStore, seconds: float = 20.0) -> None:
    """Until the replicator met the outage at least once (a loaded machine may take a while)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        st = s.replication_status()
        if st is not None and st.failures >= 1:
            return
        time.sleep(0.02)
    raise AssertionError("the replicator never met the outage")


def test_durable_outage_never_stops_saving_and_replication_catches_up(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    down = threading.Event()
    durable = FaultyBackend(backend_factory()).fail(None, transient(), persistent=True, when=down_when(down))
    s = open_tiered(durable, tmp_path / "nvme", max_replication_lag=8)
    save(s, 0)
    assert s.flush(30)
    down.set()
    for step in range(1, 4):
        save(s, step)  # never raises: the local commit does not wait for the durable tier
    wait_for_failure(s)
    st = s.replication_status()
    assert st is not None and st.lag >= 1 and st.failures >= 1 and st.last_durable_step == 0
    assert not s.flush(0.2)
    down.clear()
    assert s.flush(60)
    st = s.replication_status()
    assert st is not None and st.lag == 0 and st.last_durable_step == 3
    s.close()
    assert durable_steps(backend_factory()) == [0, 1, 2, 3]


def test_behind_by_more_than_the_bound_skips_intermediate_saves(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    down = threading.Event()
    durable = FaultyBackend(backend_factory()).fail(None, transient(), persistent=True, when=down_when(down))
    s = open_tiered(durable, tmp_path / "nvme", max_replication_lag=1, local_keep=5)
    save(s, 0)
    assert s.flush(30)
    down.set()
    for step in range(1, 6):
        save(s, step)
    wait_for_failure(s)
    down.clear()
    assert s.flush(60)
    st = s.replication_status()
    assert st is not None and st.last_durable_step == 5
    skipped = {step for step, reason in st.skipped if reason == "behind"}
    assert skipped and 5 not in skipped
    assert any(e["event"] == "replication-skipped" for e in s.events())
    s.close()
    steps = durable_steps(backend_factory())
    assert steps[0] == 0 and steps[-1] == 5 and not skipped & set(steps)


def test_a_local_only_save_is_the_resume_point_and_is_then_replicated(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    down = threading.Event()
    durable = FaultyBackend(backend_factory()).fail(
        None, transient(), persistent=True, when=lambda op, key: down.is_set() and ("/saves/" in key or "/pieces/" in key))
    s = open_tiered(durable, tmp_path / "nvme", close_flush_seconds=0.2)
    save(s, 0)
    assert s.flush(30)
    down.set()
    save(s, 1)
    latest = s.latest_complete()
    assert latest is not None and (latest.step, latest.tier) == (1, "local")
    assert not s.is_durable(latest)
    assert s.get_save(1).tier == "local" and s.get_save(0).tier == "durable"
    s.close()
    s2 = open_tiered(backend_factory(), tmp_path / "nvme")
    assert s2.resumed_from is not None and (s2.resumed_from.step, s2.resumed_from.tier) == (1, "local")
    assert s2.flush(30)
    s2.close()
    assert durable_steps(backend_factory()) == [0, 1]


def test_a_zombie_attempt_is_never_replicated_nor_selected(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    zombie = open_tiered(backend_factory(), tmp_path / "nvme-a")
    save(zombie, 0)
    assert zombie.flush(30)
    new = open_tiered(backend_factory(), tmp_path / "nvme-b")  # attempt 2, resumes from 0
    save(zombie, 1)  # the zombie still commits locally ...
    assert zombie.flush(30)
    st = zombie.replication_status()
    assert st is not None and st.fenced and st.last_durable_step == 0  # ... but it is never made durable
    assert durable_steps(backend_factory()) == [0]
    zombie.close()
    new.close()
    # a writer on the zombie's machine (its local tier) never selects the zombie's save
    again = open_tiered(backend_factory(), tmp_path / "nvme-a")
    assert again.resumed_from is not None and again.resumed_from.step == 0
    assert any("superseded" in r for r in resume_event(again)["local_reasons"])  # type: ignore[union-attr]
    again.close()


def test_another_runs_local_tier_is_set_aside(backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    other = open_tiered(Path(tmp_path / "other-durable"), tmp_path / "nvme-other")  # type: ignore[arg-type]
    for step in range(4):
        save(other, step)
    other.close()
    s = open_tiered(backend_factory(), tmp_path / "nvme")
    save(s, 0)
    assert s.flush(30)
    s.close()
    shutil.rmtree(tmp_path / "nvme")
    shutil.copytree(tmp_path / "nvme-other", tmp_path / "nvme")  # planted: same run ID, another run
    s2 = open_tiered(backend_factory(), tmp_path / "nvme")
    assert s2.resumed_from is not None and s2.resumed_from.step == 0 and s2.resumed_from.tier == "durable"
    assert resume_event(s2)["local_quarantined"]
    assert (tmp_path / "nvme" / ".quarantine").is_dir()
    s2.close()


def test_gc_of_one_tier_never_touches_the_other(backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    s = open_tiered(backend_factory(), tmp_path / "nvme", local_keep=10, max_replication_lag=10)
    for step in range(4):
        save(s, step)
    assert s.flush(30)
    s.gc_local(keep_last=1, grace_seconds=0)
    assert durable_steps(backend_factory()) == [0, 1, 2, 3]
    s.gc(keep_last=1, grace_seconds=0)
    assert durable_steps(backend_factory()) == [3]
    local = [i for i in s.list_saves() if i.ref is not None]
    assert [(i.step, i.ref.tier) for i in local] == [(3, "both")]  # type: ignore[union-attr]
    s.close()
