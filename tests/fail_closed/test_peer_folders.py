"""Peer copies are input too (issue 33; protocol_spec/THREATS.md §4.16): hostile
objects planted in a node's peer folders (``<local>/rank-<h>/.peers/rank-<s>``)
and lying frames on the link between ranks, in one process.

A two-rank job (``tests/tiers/test_parts.py``'s coordinator and member on
one durable directory) saves steps 1 (durable) to 3 (local only); each rank
folder is then copied into the other's ``.peers`` folder, as the copy thread
leaves it. The link between the ranks is :class:`Wire`, an in-memory byte
stream per (sender, receiver) with a bounded wait, so a sender can send any
bytes at all. Every test asserts what is refused or ignored, with its
reason, and that nothing outside the folder it belongs to changed
(snapshots, links never followed)."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions, TierOptions
from ckptstore.core.record_auth import RecordAuth
from ckptstore.errors import CkptStoreError, CorruptionError, SupersededError
from ckptstore.protocol import CommitRecord
from ckptstore.tiers import (
    PeerCopyError,
    local_holdings,
    peer_holdings,
    plan_repair,
    receive_frame,
    send_held_part,
    write_back,
)
from ckptstore.tiers import peer_copies as pc

IDENT = {"model": "tiny", "world_size": 2}
AUTH = RecordAuth("off", None)
WAIT = 2.0  # seconds a receive waits for bytes that never come


# ------------------------------------------------------------------ the link
class Wire:
    """Every rank's end of an in-memory link: one byte stream per (sender,
    receiver), so a lying sender may send any bytes in any cut. A receive
    that does not get its bytes in :data:`WAIT` seconds is :class:`PeerCopyError`
    (as ``GlooPeerLink`` on the group's timeout)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.streams: dict[tuple[int, int], bytearray] = {}

    def end(self, rank: int) -> End:
        return End(self, rank)

    def left(self, src: int, dst: int) -> bytes:
        with self.cond:
            return bytes(self.streams.get((src, dst), b""))


@dataclass
class End:
    wire: Wire
    rank: int

    def send(self, dst: int, data: bytes | bytearray | memoryview) -> None:
        with self.wire.cond:
            self.wire.streams.setdefault((self.rank, dst), bytearray()).extend(bytes(data))
            self.wire.cond.notify_all()

    def recv(self, src: int, n: int) -> bytes:
        with self.wire.cond:
            buf = self.wire.streams.setdefault((src, self.rank), bytearray())
            if not self.wire.cond.wait_for(lambda: len(buf) >= n, WAIT):
                raise PeerCopyError(f"rank {self.rank}: rank {src} did not answer in time")
            out = bytes(buf[:n])
            del buf[:n]
            return out


# ------------------------------------------------------------------ the job
@dataclass
class Job:
    base: Path
    digest: str
    refs: dict[int, Any]

    @property
    def local(self) -> Path:
        return self.base / "local"

    @property
    def url(self) -> str:
        return str(self.base / "durable")

    def peer(self, holder: int, sender: int) -> Path:
        return self.local / f"rank-{holder}" / ".peers" / f"rank-{sender}"

    def own(self, rank: int) -> Path:
        return self.local / f"rank-{rank}"


def open_pair(base: Path, peers: dict[int, Any] | None = None) -> tuple[CheckpointStore, CheckpointStore]:
    tiers = TierOptions(base / "local", close_flush_seconds=0.5, replicate_every=10, keep=5)
    coord = CheckpointStore.open(str(base / "durable"), "run", identity=IDENT, options=OpenOptions(
        single_writer=True, tiers=replace(tiers, rank=0, peers=peers or {})))
    assert coord.attempt is not None
    member = CheckpointStore.open(str(base / "durable"), "run", identity=IDENT, join_attempt=coord.attempt.number,
                                  options=OpenOptions(tiers=replace(tiers, rank=1)))
    return coord, member


def part(step: int, rank: int) -> bytes:
    return bytes((step * 31 + rank * 7 + i) % 251 + 1 for i in range(5000 + 2000 * rank))


def save(coord: CheckpointStore, member: CheckpointStore, step: int) -> Any:
    sid = coord.new_save_id(step)
    a, b = coord.stage(step, save_id=sid), member.stage(step, save_id=sid)
    ca, cb = a.put("rank0/w", part(step, 0)), b.put("rank1/w", part(step, 1))
    ref = coord.publish(step, sid, {ca.name: ca, cb.name: cb}, ranks={0: [ca.name], 1: [cb.name]}, world_size=2)
    member.publish_record(ref.record.encode())
    return ref


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Steps 1 (durable too), 2 and 3 (local only) of attempt 1; each rank's
    folder copied into the other's peer folder (what the copy thread leaves)."""
    base = tmp_path_factory.mktemp("peerjob")
    coord, member = open_pair(base)
    refs = {step: save(coord, member, step) for step in (1, 2, 3)}
    assert coord.flush(10) and member.flush(10)
    digest = coord.identity_digest
    coord.close()
    member.close()
    job = Job(base, digest, refs)
    for holder, sender in ((0, 1), (1, 0)):
        shutil.copytree(job.own(sender) / "run", job.peer(holder, sender) / "run")
    with CheckpointStore.open(job.url, "run") as s:
        got = s.latest_complete()
        assert got is not None and got.step == 1
    return job


@pytest.fixture
def job(made: Job, tmp_path: Path) -> Job:
    shutil.copytree(made.base, tmp_path / "job", symlinks=True)
    return Job(tmp_path / "job", made.digest, made.refs)


def snapshot(top: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry under ``top`` (links not followed): kind and content."""
    out: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else \
                "file" if stat.S_ISREG(st.st_mode) else "other"
            out[str(p.relative_to(top))] = (kind, p.read_bytes() if kind == "file" else os.readlink(p).encode()
                                            if kind == "link" else b"")
    return out


def steps(held: list[dict[str, Any]]) -> list[int]:
    return [h["step"] for h in held]


def holdings(job: Job, holder: int) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    return peer_holdings(job.local, "run", holder, job.digest, AUTH)


def fetch(job: Job, step: int, attempt: int = 1, *, holder: int = 0, owner: int = 1) -> Any:
    """The write-back of ``owner``'s part of ``step`` from ``holder``'s peer folder, as ``setup_peers`` runs it."""
    wire = Wire()
    failed = send_held_part(wire.end(holder), owner, job.local, holder, owner, "run", step, attempt, job.digest,
                            AUTH)
    frame = receive_frame(wire.end(owner), holder, owner, "run")
    if frame is None:
        return None, failed
    try:
        return write_back(frame, job.local, owner, job.url, None, AUTH, job.digest, None), failed
    finally:
        assert wire.left(holder, owner) == b""  # the frame was consumed whole, whatever happened


def commits(folder: Path) -> set[str]:
    d = folder / "run" / "commits"
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def save_files(folder: Path, save_id: str) -> list[str]:
    d = folder / "run" / "saves" / save_id
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


# ------------------------------------------------------------------ baseline
def test_a_sound_peer_copy_is_held_planned_and_written_back_bit_for_bit(job: Job) -> None:
    """The way every hostile case below is refused on works for a sound copy."""
    held, why = holdings(job, 0)
    assert {s: steps(h) for s, h in held.items()} == {1: [3, 2]} and not why, why
    shutil.rmtree(job.own(1))  # node b's disk is lost
    own0, _ = local_holdings(job.local, "run", 0, job.digest, AUTH)
    plan, everywhere, anywhere = plan_repair({0: own0, 1: []}, {0: held}, 2)
    assert plan is not None and plan.target[0] == 3 and plan.fetch == {1: 0}
    assert (everywhere, anywhere) == (3, 3)
    ref, failed = fetch(job, 3)
    assert not failed and ref.manifest_digest == job.refs[3].manifest_digest
    back, why = local_holdings(job.local, "run", 1, job.digest, AUTH)
    assert steps(back) == [3], why
    sid = job.refs[3].save_id
    assert (job.own(1) / "run" / "saves" / sid / "rank1" / "w").read_bytes() == part(3, 1)
