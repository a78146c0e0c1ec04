"""A local tier with hostile objects planted in it (issue 30, classes 2-4;
protocol_spec/THREATS.md §4.12): a link at a rank folder, at the run's
folder or at ``.quarantine``, a tier that is the durable run's folder, and a
local attempt record the durable tier never had. The durable tier is memory,
a local directory (the case where the two can share a folder) and object
stores. Every test asserts: the refusal is a ``LocalTierRefusedError`` naming
the path and the fix, nothing outside the tier and the store changed
(snapshots), the durable saves are untouched, and real saves still resume
bit for bit."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptstore import CheckpointStore, OpenOptions, TierOptions
from ckptstore.backends.base import Backend
from ckptstore.backends.local import LocalBackend, PosixOps
from ckptstore.cli.commands import main as cli_main
from ckptstore.core.record_auth import RecordAuth
from ckptstore.errors import CkptStoreError, LocalTierRefusedError, SupersededError
from ckptstore.protocol import AttemptRecord, attempt_key
from ckptstore.tiers.parts import local_holdings
from ckptstore.tiers.tier_dir import quarantine_run_folder
from tests.helpers import settle_background_writes

IDENT = {"model": "tiny", "seed": 1}
RANKED = {"model": "tiny", "world_size": 1}
backend_kinds = ("memory", "local", "moto", "fakegcs")


def payload(step: int) -> bytes:
    return bytes((step * 13 + i) % 251 for i in range(2500))


def save(store: CheckpointStore, step: int) -> None:
    with store.save(step) as w:
        w.put("a", payload(step))


def snapshot(top: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every entry under ``top`` (links not followed): kind, mode, content."""
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
            out[str(p.relative_to(top))] = (kind, stat.S_IMODE(st.st_mode), data)
    return out


def durable_state(backend: Backend) -> dict[str, bytes]:
    """Every object of the run in the durable tier but the ledger (which a refused open may append to)."""
    return {k: backend.get(k) for k in backend.list_keys("run/") if "/events/" not in k}


def durable_saves(backend: Backend) -> dict[int, bytes]:
    """step -> component ``a`` of every committed durable save, read back verified."""
    r = CheckpointStore.open(backend, "run", mode="r")
    out = {}
    for i in r.list_saves():
        if i.state.value == "committed" and i.ref is not None:
            out[i.step] = r.read(i.ref, "a")
    return out


def elsewhere(tmp_path: Path) -> Path:
    """A user's directory the planted links point to: a folder named like the run, files in it."""
    d = tmp_path / "elsewhere"
    (d / "run" / "attempts").mkdir(parents=True)
    (d / "run" / "notes.txt").write_bytes(b"a user's file, not ckptstore's")
    (d / "model.bin").write_bytes(b"precious")
    return d


@pytest.fixture
def other_device(tmp_path: Path) -> Iterator[Path]:
    """A directory on another file system than ``tmp_path`` when the machine has one (/dev/shm)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        d = Path(tempfile.mkdtemp(prefix="ckpt-q-", dir=shm))
    else:
        d = tmp_path / "q-target"
        d.mkdir()
    (d / "keep.txt").write_bytes(b"do not touch")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def refused(exc: pytest.ExceptionInfo[CkptStoreError], *words: str) -> None:
    msg = str(exc.value)
    assert isinstance(exc.value, LocalTierRefusedError), repr(exc.value)
    for w in words:
        assert w in msg, msg
    assert "remove" in msg or "choose another local_tier" in msg, msg  # the fix


def with_durable_saves(backend: Backend, steps: range) -> None:
    with CheckpointStore.open(backend, "run", identity=IDENT) as s:
        for step in steps:
            save(s, step)


# ---------------------------------------------------------------- class 2
@pytest.mark.backends("local")
def test_a_rank_folder_linked_to_the_durable_directory_is_refused(tmp_path: Path) -> None:
    """The issue's case: ``<tier>/rank-0`` -> the durable store's directory on a
    shared file system; the rank's retention would have deleted durable saves."""
    durable = tmp_path / "durable"
    with CheckpointStore.open(str(durable), "run", identity=RANKED) as s:
        for step in range(1, 6):
            save(s, step)
    tier = tmp_path / "nvme"
    tier.mkdir()
    (tier / "rank-0").symlink_to(durable)
    before = snapshot(durable)
    for _ in range(2):
        with pytest.raises(CkptStoreError) as exc:
            CheckpointStore.open(str(durable), "run", identity=RANKED, options=OpenOptions(
                single_writer=True, tiers=TierOptions(tier, keep=1, rank=0, peers={})))
        refused(exc, "rank-0", "symbolic link")
    assert snapshot(durable) == before
    assert sorted(durable_saves(LocalBackend(durable))) == [1, 2, 3, 4, 5]
    # a member rank's holdings report of the same link reads nothing through it
    held, why = local_holdings(tier, "run", 0, "x", RecordAuth("off", None))
    assert held == [] and "symbolic link" in why[0]
    # the operator removes the link: the rank's real folder works, every durable save is kept
    (tier / "rank-0").unlink()
    with CheckpointStore.open(str(durable), "run", identity=RANKED, options=OpenOptions(
            single_writer=True, tiers=TierOptions(tier, keep=1, rank=0, peers={}))) as s:
        assert s.resumed_from is not None and s.resumed_from.step == 5 and s.read(s.resumed_from, "a") == payload(5)
        save(s, 6)
        save(s, 7)
        assert s.flush(30)
    assert durable_saves(LocalBackend(durable)) == {k: payload(k) for k in range(1, 8)}
    assert not (tier / "rank-0").is_symlink() and (tier / "rank-0" / "run").is_dir()


@pytest.mark.backends("local")
@pytest.mark.parametrize("where", ["the-store", "the-run-folder", "inside-the-run", "run-link"])
def test_a_tier_that_shares_the_durable_run_folder_is_refused(tmp_path: Path, where: str) -> None:
    durable = tmp_path / "durable"
    with_durable_saves(LocalBackend(durable), range(1, 4))
    tier = {"the-store": durable, "the-run-folder": durable / "run", "inside-the-run": durable / "run" / "x",
            "run-link": tmp_path / "nvme"}[where]
    if where == "run-link":  # one process: <tier>/run is a link to the durable run's folder
        tier.mkdir()
        (tier / "run").symlink_to(durable / "run")
    before = snapshot(tmp_path)
    with pytest.raises(CkptStoreError) as exc:
        CheckpointStore.open(str(durable), "run", identity=IDENT, local_tier=tier, local_keep=1)
    if where == "run-link":
        refused(exc, str(tier / "run"), "symbolic link")
    else:
        refused(exc, "durable", "retention would delete durable saves")
    assert snapshot(tmp_path) == before  # nothing created, not even the tier's root
    assert durable_saves(LocalBackend(durable)) == {k: payload(k) for k in range(1, 4)}


def test_a_rank_folder_linked_elsewhere_writes_nothing_there(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    target = elsewhere(tmp_path)
    with CheckpointStore.open(backend_factory(), "run", identity=RANKED) as s:
        save(s, 1)
    tier = tmp_path / "nvme"
    tier.mkdir()
    (tier / "rank-0").symlink_to(target)
    before, durable_before = snapshot(target), durable_state(backend_factory())
    with pytest.raises(CkptStoreError) as exc:
        CheckpointStore.open(backend_factory(), "run", identity=RANKED, options=OpenOptions(
            single_writer=True, tiers=TierOptions(tier, rank=0, peers={})))
    refused(exc, str(tier / "rank-0"))
    assert snapshot(target) == before and durable_state(backend_factory()) == durable_before
    assert (tier / "rank-0").is_symlink()  # never replaced nor removed: the operator decides
    (tier / "rank-0").unlink()
    with CheckpointStore.open(backend_factory(), "run", identity=RANKED, options=OpenOptions(
            single_writer=True, tiers=TierOptions(tier, rank=0, peers={}))) as s:
        assert s.resumed_from is not None and s.read(s.resumed_from, "a") == payload(1)
        save(s, 2)
        assert s.flush(30)
    assert durable_saves(backend_factory()) == {1: payload(1), 2: payload(2)}
    assert snapshot(target) == before


def test_a_run_folder_link_in_a_one_process_tier_is_refused_and_the_cli_says_so(
        backend_factory: Callable[[], Backend], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = elsewhere(tmp_path)
    with_durable_saves(backend_factory(), range(1, 3))
    tier = tmp_path / "nvme"
    tier.mkdir()
    (tier / "run").symlink_to(target / "run")
    before, durable_before = snapshot(target), durable_state(backend_factory())
    with pytest.raises(CkptStoreError) as exc:
        CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier)
    refused(exc, str(tier / "run"))
    with pytest.raises(CkptStoreError):
        CheckpointStore.open(backend_factory(), "run", mode="r", local_tier=tier)
    if isinstance(backend_factory(), LocalBackend):  # the CLI reaches the same store by its URL
        rc = cli_main(["ls", str(tmp_path / "store"), "run", "--local-tier", str(tier)])
        err = capsys.readouterr().err
        assert rc != 0 and "symbolic link" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert snapshot(target) == before and durable_state(backend_factory()) == durable_before
    (tier / "run").unlink()
    with CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier) as s:
        assert s.resumed_from is not None and s.read(s.resumed_from, "a") == payload(2)
    assert snapshot(target) == before


# ---------------------------------------------------------------- class 3
def plant_foreign_run(tier: Path) -> None:
    """The tier's run folder holds another run's RUN.json (the open must set it aside)."""
    (tier / "run").mkdir(parents=True, exist_ok=True)
    rr = tier / "run" / "RUN.json"
    if rr.exists():
        rr.unlink()
    rr.write_bytes(b'{"not":"this run"}')


def test_a_quarantine_link_is_refused_and_nothing_is_moved(
        backend_factory: Callable[[], Backend], tmp_path: Path, other_device: Path) -> None:
    tier = tmp_path / "nvme"
    with CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier) as s:
        save(s, 1)
        assert s.flush(30)
    plant_foreign_run(tier)
    (tier / ".quarantine").symlink_to(other_device)
    target_before, tier_before = snapshot(other_device), snapshot(tier)
    durable_before = durable_state(backend_factory())
    with pytest.raises(CkptStoreError) as exc:
        CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier)
    refused(exc, ".quarantine", "symbolic link")
    assert "by hand" in str(exc.value)
    assert snapshot(other_device) == target_before and snapshot(tier) == tier_before  # nothing moved
    assert durable_state(backend_factory()) == durable_before
    (tier / ".quarantine").unlink()
    with CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier) as s:
        assert s.resumed_from is not None and s.resumed_from.tier == "durable"
        assert s.read(s.resumed_from, "a") == payload(1)
        ev = [e for e in s.events() if e["event"] == "resume-tier"][-1]["payload"]
        assert "RUN.json" in ev["local_quarantined"]
    moved = [p for p in (tier / ".quarantine").iterdir()]
    assert len(moved) == 1 and (moved[0] / "RUN.json").read_bytes() == b'{"not":"this run"}'
    assert snapshot(other_device) == target_before


class CrossDevice(PosixOps):
    """Every rename fails as between two file systems (``.quarantine`` a mount point)."""

    def rename(self, src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", src)


def test_a_move_across_file_systems_is_a_ckptstore_error_naming_the_fix(tmp_path: Path) -> None:
    tier = tmp_path / "nvme"
    (tier / "run").mkdir(parents=True)
    (tier / "run" / "RUN.json").write_bytes(b"{}")
    backend = LocalBackend(tier, ops=CrossDevice())
    before = snapshot(tier)
    with pytest.raises(LocalTierRefusedError) as exc:
        quarantine_run_folder(backend, "run")
    assert "another file system" in str(exc.value) and "by hand" in str(exc.value)
    after = snapshot(tier)
    assert after.pop(".quarantine")[0] == "dir" and after == before
    assert quarantine_run_folder(LocalBackend(tier), "run") is not None  # without the fault: moved aside
    assert not (tier / "run").exists()


# ---------------------------------------------------------------- class 4
def plant_attempt(tier: Path, number: int, resumed_from: int | None = 0) -> None:
    rec = AttemptRecord("run", number, resumed_from, "f" * 32, 1.0, (), "elsewhere")
    p = tier / attempt_key("run", number)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(rec.encode())


def test_a_local_only_attempt_record_fences_nothing_and_is_reported(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    tier = tmp_path / "nvme"
    with CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier) as s:
        save(s, 1)
        assert s.flush(30)
    plant_attempt(tier, 50)
    durable_keys = set(backend_factory().list_keys("run/attempts/"))
    with CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier) as s:
        ev = [e for e in s.events() if e["event"] == "resume-tier"][-1]["payload"]
        assert ev["local_ignored_attempts"] == [50]  # noticed at the open, not at the first save
        ignored = [e["payload"] for e in s.events() if e["event"] == "local-attempt-ignored"]
        assert ignored and ignored[0]["number"] == 50 and "durable tier has no attempt record" in ignored[0]["why"]
        assert s.resumed_from is not None and s.read(s.resumed_from, "a") == payload(1)
        save(s, 2)  # not superseded by the planted record
        plant_attempt(tier, 60, resumed_from=None)  # planted while the writer runs
        save(s, 3)
        assert s.flush(30)
        assert any(e["payload"]["number"] == 60 for e in s.events() if e["event"] == "local-attempt-ignored")
        assert s.latest_complete() is not None and s.latest_complete().step == 3  # type: ignore[union-attr]
    assert "run/attempts/00000050.json" not in backend_factory().list_keys("run/attempts/")
    assert set(backend_factory().list_keys("run/attempts/")) - durable_keys  # only the real new attempt
    assert durable_saves(backend_factory()) == {k: payload(k) for k in (1, 2, 3)}
    with CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier) as s:
        assert s.resumed_from is not None and s.resumed_from.step == 3 and s.resumed_from.tier == "both"
        assert s.read(s.resumed_from, "a") == payload(3)


def test_a_newer_attempt_on_the_same_tier_still_fences_the_old_writer(
        backend_factory: Callable[[], Backend], tmp_path: Path) -> None:
    """The durable tier confirms a real newer attempt mirrored by another writer on this machine."""
    tier = tmp_path / "nvme"
    old = CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier)
    save(old, 1)
    assert old.flush(30)
    new = CheckpointStore.open(backend_factory(), "run", identity=IDENT, local_tier=tier)
    with pytest.raises(SupersededError):
        save(old, 2)
    save(new, 2)
    assert new.flush(30)
    old.close()
    new.close()
    assert durable_saves(backend_factory()) == {1: payload(1), 2: payload(2)}


# ------------------------------------------------------- two gloo ranks
@pytest.mark.backends("local")
def test_a_rank_folder_link_on_a_job_of_two_ranks_refuses_the_job(tmp_path: Path) -> None:
    """``open_distributed(..., local_tier=...)`` with 2 gloo ranks: rank 1's
    folder is a link to the durable store's directory. The job's open fails
    on every rank (all ranks or none) with the refusal; the durable saves and
    the durable directory's saves are untouched; with the link removed the
    job resumes from the durable save, bit for bit."""
    pytest.importorskip("torch.distributed")
    from tests.workers.dist_launch import run_job
    from tests.workers.dist_worker import blob

    worker = str(Path(__file__).parents[1] / "workers" / "tier_rank_worker.py")
    durable, local = tmp_path / "durable", tmp_path / "local"
    res = run_job(2, str(durable), "tiers", args={"local": str(local), "steps": [1], "flush": 20}, worker=worker,
                  timeout=90)
    assert all(r.results["save1"]["ok"] and r.results["flush"]["ok"] for r in res), [r.results for r in res]
    shutil.rmtree(local / "rank-1")
    (local / "rank-1").symlink_to(durable)
    saves_before = snapshot(durable / "run" / "saves")
    res = run_job(2, str(durable), "tiers", args={"local": str(local), "steps": [2]}, worker=worker, timeout=90)
    opens = [r.results.get("open", {}) for r in res]
    assert not any(o.get("ok") for o in opens), opens
    assert any(o.get("type") == "LocalTierRefusedError" and "rank-1" in o.get("message", "") for o in opens), opens
    assert snapshot(durable / "run" / "saves") == saves_before
    (local / "rank-1").unlink()
    res = run_job(2, str(durable), "tiers", args={"local": str(local), "steps": [2], "flush": 20}, worker=worker,
                  timeout=90)
    for r in res:
        assert r.results["open"]["ok"] and r.results["open"]["resumed"] == 1, r.results
        assert r.results["read"]["ok"], r.results  # each rank's part, verified (blob(1, rank))
        assert r.results["save2"]["ok"] and r.results["flush"]["ok"], r.results
    with CheckpointStore.open(str(durable), "run", mode="r") as s:
        ref = s.latest_complete(deep=True)
        assert ref is not None and ref.step == 2 and s.read(ref, "rank1/model") == blob(2, 1)
