"""``RankStore`` / ``open_distributed`` on a protocol-version-3 run (pieces,
PROTOCOL.md §9.4): two real rank processes (gloo on 127.0.0.1,
tests/workers/piece_rank_worker.py) fine-tune a head over a frozen backbone
with the Checkpointer's defaults. Every save after a rank's first reuses the
frozen pieces (each rank learns the coordinator's commit), a resumed job
continues bit for bit, and gc running beside the job — another process's
and the coordinator's retention — never takes a piece a save needs."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, SaveState
from ckptstore.backends.local import LocalBackend
from ckptstore.protocol.layout import pieces_prefix
from tests.incremental.common import GRACE, LONG, Clock, long_timing
from tests.workers.dist_launch import RankResult, run_job

WORKER = str(Path(__file__).parents[1] / "workers" / "piece_rank_worker.py")
#: the ranks' and every reader's timing: intents live LONG (no save of a loaded machine outlives its
#: protection); gc's pieces age by its own injected clock (see the gc test)
TIMING = long_timing()
IDENT = {"data_digest": "d", "code_digest": "c", "world_size": 2}
STOP = 10
BACKBONE = 1024 * 512 * 4  # bytes of the frozen weight


def make_v3(url: str) -> None:
    CheckpointStore.open(url, "run", identity=IDENT, protocol_version=3, piece_timing=TIMING).close()


def job(url: str, stop: int, keep_last: int | None = None) -> list[dict[str, Any]]:
    res: list[RankResult] = run_job(2, url, "train", worker=WORKER, timeout=180, args={
        "stop": stop, "keep_last": keep_last, "window": TIMING.window, "intent_ttl": TIMING.intent_ttl})
    out = [r.results.get("ckpt") for r in res]
    assert all(o is not None and o["ok"] for o in out), [(r.rank, r.returncode, r.results, r.stderr[-3000:]) for r in res]
    return out  # type: ignore[return-value]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    url = str(tmp_path_factory.mktemp("ranks-ref") / "store")
    make_v3(url)
    return url, job(url, STOP)


def assert_same_training(resumed: list[dict[str, Any]], full: list[dict[str, Any]]) -> None:
    for r, (a, b) in enumerate(zip(full, resumed, strict=True)):
        assert b["start"] > 0, r  # it did resume
        assert b["head"] == a["head"] and b["moments"] == a["moments"], r  # bit for bit
        assert b["backbone"] == a["backbone"], r


def committed(url: str) -> list[Any]:
    st = CheckpointStore.open(url, "run", mode="r", piece_timing=TIMING)
    return [i.ref for i in st.list_saves(grace_seconds=0) if i.state is SaveState.COMMITTED]


def backbone_holders(ref: Any) -> dict[int, str]:
    """rank -> the save holding the piece of that rank's frozen weight."""
    out = {}
    for name, c in ref.components.items():
        if name.endswith("model.safetensors") and c.pieces is not None:
            big = [p for p in c.pieces if p.size == BACKBONE]
            assert len(big) == 1, (name, [p.size for p in c.pieces])
            out[int(name.split("/")[0].removeprefix("rank"))] = big[0].holder
    assert sorted(out) == [0, 1], sorted(ref.components)
    return out


def test_every_rank_reuses_the_frozen_pieces(uninterrupted: tuple[str, list[dict[str, Any]]]) -> None:
    url, _ = uninterrupted
    refs = sorted(committed(url), key=lambda r: r.step)
    assert len(refs) >= 4
    first = refs[0].save_id
    for ref in refs:
        assert backbone_holders(ref) == {0: first, 1: first}, ref.step  # written once, by the first save
    for ref in refs[1:]:
        # the frozen weight of both ranks is referenced, not written again
        assert ref.record.bytes_written() <= ref.total_bytes - 2 * BACKBONE, ref.step


def test_a_resumed_job_reuses_and_continues_bit_for_bit(
    uninterrupted: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url = str(tmp_path / "store")
    make_v3(url)
    job(url, 5)
    before = {r.save_id for r in committed(url)}
    resumed = job(url, STOP)
    assert_same_training(resumed, uninterrupted[1])
    later = [r for r in committed(url) if r.save_id not in before]
    assert later
    for ref in later:  # the resumed job's first save already reuses the pieces of its resume point
        assert set(backbone_holders(ref).values()) <= before, ref.step


def test_gc_beside_the_job_never_takes_a_needed_piece(
    uninterrupted: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url = str(tmp_path / "store")
    make_v3(url)
    stop = threading.Event()
    reports: list[tuple[bool, Any]] = []  # (whether gc judged by the fixed clock, its report)
    errors: list[BaseException] = []
    #: gc's clock: the real one during the first job (nothing is old yet), then fixed where every piece
    #: the first job wrote is older than the grace and everything the second job writes is young (the
    #: ranks date their intents by the real clock: the second job's are live to it, LONG from now)
    gclock = Clock()

    def collect() -> None:
        while not stop.is_set():
            try:
                fixed = gclock.fixed is not None
                reports.append((fixed, CheckpointStore.open(url, "run", mode="r", piece_timing=long_timing(gclock))
                                .gc(keep_last=1, grace_seconds=GRACE)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return
            stop.wait(0.05)

    t = threading.Thread(target=collect, daemon=True)
    t.start()
    try:
        job(url, 5, keep_last=1)
        first_job = LocalBackend(url).list(pieces_prefix("run"))
        first = max(o.mtime for o in first_job)
        time.sleep(1.1)  # a lower bound only: the second job writes (and dates its intents) a second later
        gclock.fixed = first + LONG + 0.5  # the first job's pieces age past the grace period while gc keeps running
        resumed = job(url, STOP, keep_last=1)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert_same_training(resumed, uninterrupted[1])
    # not vacuous: gc ran beside the second job with the first job's pieces past the grace period, and the
    # first job's pieces that no kept save names went while the job ran (swept by this gc or by the job's own
    # retention, which takes a deleted save's pieces at any age, §9.5 step 5, and is often first: which of
    # the two sweeps them is a race, so neither is required to)
    assert any(fixed for fixed, _ in reports), "no gc ran beside the second job with the fixed clock"
    assert {o.key for o in first_job} - set(LocalBackend(url).list_keys(pieces_prefix("run")))
    reader = CheckpointStore.open(url, "run", mode="r", piece_timing=TIMING)
    for ref in committed(url):
        assert reader.verify(ref, deep=True).ok, ref.step
