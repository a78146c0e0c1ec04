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
(snapshots, links never followed).

The job runs at protocol versions 2 and 3 (the ``version`` fixture). The
tests that send and receive a frame on one thread, or plant whole
components under ``saves/``, are version 2's (``VERSION_2``); their version-3
counterparts, a part copied as its pieces with both ends on their own
threads, are tests/fail_closed/test_peer_pieces.py. The planted folders,
links, odd names, foreign runs and identities, zombies' holdings and lying
frame headers are judged the same on both versions."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions, TierOptions
from ckptstore.core.record_auth import RecordAuth
from ckptstore.errors import CkptStoreError, CorruptionError, SupersededError
from ckptstore.protocol import CommitRecord
from ckptstore.protocol.records import MAX_COMMIT_RECORD
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
from ckptstore.tiers import peer_frames as pf
from ckptstore.tiers import peer_repair as pr
from tests.helpers import settle_background_writes
from tests.peer_wire import End, Wire

IDENT = {"model": "tiny", "world_size": 2}
AUTH = RecordAuth("off", None)


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


def open_pair(base: Path, peers: dict[int, Any] | None = None, version: int | None = None,
              ) -> tuple[CheckpointStore, CheckpointStore]:
    tiers = TierOptions(base / "local", close_flush_seconds=0.5, replicate_every=10, keep=5)
    coord = CheckpointStore.open(str(base / "durable"), "run", identity=IDENT, options=OpenOptions(
        protocol_version=version, single_writer=True, tiers=replace(tiers, rank=0, peers=peers or {})))
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


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3"])
def version(request: pytest.FixtureRequest) -> int:
    """The job's protocol version; a test of version 2's layout (whole components under ``saves/``)
    is pinned to it with :data:`WHOLE_COMPONENTS` (its version-3 counterpart: test_peer_pieces.py)."""
    return int(request.param)


#: pins a test to version 2: it sends and receives a frame on one thread (:func:`fetch`, a version-2
#: frame; a version-3 frame waits for the receiver's reply, so test_peer_pieces.py runs both ends on
#: two threads), or it plants or reads whole components under ``saves/``
VERSION_2 = pytest.mark.parametrize("version", [2], indirect=True, ids=["v2"], scope="module")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, version: int) -> Job:
    """Steps 1 (durable too), 2 and 3 (local only) of attempt 1; each rank's
    folder copied into the other's peer folder (what the copy thread leaves)."""
    base = tmp_path_factory.mktemp("peerjob")
    coord, member = open_pair(base, version=version)
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
    settle_background_writes()  # a version-3 save's next intent lands after the save returned
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
@VERSION_2
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


@VERSION_2
def test_a_write_back_killed_before_its_commit_is_done_again_at_the_next_open(job: Job) -> None:
    """A process killed after the written-back components landed but before
    their commit record: that folder holds nothing (no commit), and the next
    open's write-back writes the same save again over the leftovers."""
    shutil.rmtree(job.own(1))
    ref, _ = fetch(job, 3)
    for c in (job.own(1) / "run" / "commits").iterdir():
        c.unlink()  # the commit record never landed
    assert local_holdings(job.local, "run", 1, job.digest, AUTH)[0] == []
    again, failed = fetch(job, 3)
    assert not failed and again.manifest_digest == ref.manifest_digest
    assert steps(local_holdings(job.local, "run", 1, job.digest, AUTH)[0]) == [3]
    sid = job.refs[3].save_id
    assert (job.own(1) / "run" / "saves" / sid / "rank1" / "w").read_bytes() == part(3, 1)


# ------------------------------------------------------------ planted folders
def elsewhere(tmp_path: Path, job: Job) -> Path:
    """A user's folder the planted links point to, holding a sound copy of rank 1's
    part (so a link followed would be visible: reported held, or written into)."""
    d = tmp_path / "elsewhere"
    shutil.copytree(job.peer(0, 1), d / "rank-1")
    (d / "notes.txt").write_bytes(b"a user's file, not ckptstore's")
    return d


LINKED = {".peers": ("rank-0/.peers", "elsewhere"), "sender folder": ("rank-0/.peers/rank-1", "elsewhere/rank-1"),
          "run folder": ("rank-0/.peers/rank-1/run", "elsewhere/rank-1/run")}


def plant_link(job: Job, tmp_path: Path, where: str) -> tuple[Path, Path]:
    """``where`` (a key of :data:`LINKED`) replaced by a link into :func:`elsewhere`."""
    away = elsewhere(tmp_path, job)
    rel, target = LINKED[where]
    shutil.rmtree(job.local / rel)
    (job.local / rel).symlink_to(tmp_path / target, target_is_directory=True)
    return away, job.local / rel


@pytest.mark.parametrize("where", sorted(LINKED))
def test_a_link_in_a_peer_folder_is_never_followed_nor_reported_held(job: Job, tmp_path: Path, where: str) -> None:
    away, link = plant_link(job, tmp_path, where)
    before, local_before = snapshot(away), snapshot(job.own(0) / "run")
    held, why = holdings(job, 0)
    assert held == {}, held  # the sound copy behind the link is not reported
    assert why and any("symbolic link" in w or "not a directory" in w or "unreadable" in w for w in why), why
    # a holder asked to send it anyway (a plan from elsewhere) sends "nothing": the owner holds nothing new
    shutil.rmtree(job.own(1))
    ref, failed = fetch(job, 3)
    assert ref is None and failed, failed
    assert not job.own(1).exists() or commits(job.own(1)) == set()
    assert snapshot(away) == before and snapshot(job.own(0) / "run") == local_before
    assert link.is_symlink()  # never removed, never replaced


def test_odd_names_and_entries_in_peers_are_ignored_with_a_reason(job: Job) -> None:
    """Strict names: ``rank-<n>`` in canonical decimal of another rank, a real
    folder. Each odd one holds a sound copy of rank 1's part, so a loose parse
    (``int("01") == 1``) would report it; none is."""
    top = job.own(0) / ".peers"
    sound = top / "rank-1"
    odd = ["rank-01", "rank--1", "rank-x", "rank-1 ", "rank-+1", "RANK-1", "rank-0", "rank-1000000000", "rank-"]
    for name in odd:
        shutil.copytree(sound, top / name)
    shutil.rmtree(sound)
    (top / "rank-2").write_bytes(b"a file, not a folder")
    os.mkfifo(top / "rank-3")  # never opened: it would block a reader
    (top / "stray.txt").write_bytes(b"x")
    before = snapshot(top)
    held, why = holdings(job, 0)
    assert held == {}, held
    text = "\n".join(why)
    for name in [*odd[:7], "stray.txt"]:
        assert f"{name!r} is not a peer folder" in text, (name, why)
    assert "rank-2" in text and "rank-3" in text, why  # a file and a FIFO where a folder belongs: said, not opened
    assert snapshot(top) == before


def test_more_than_eight_peer_folders_are_not_all_looked_at(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    top = job.own(0) / ".peers"
    for s in range(2, 14):
        (top / f"rank-{s}").mkdir()
    looked: list[str | None] = []
    real = pr.local_holdings

    def counted(*args: Any, **kw: Any) -> Any:
        looked.append(kw.get("folder"))
        return real(*args, **kw)

    monkeypatch.setattr(pr, "local_holdings", counted)
    held, why = holdings(job, 0)
    assert len(looked) == pr.MAX_PEER_FOLDERS == 8, looked
    assert {s: steps(h) for s, h in held.items()} == {1: [3, 2]}  # rank-1 sorts first: still read
    assert any("more than 8 peer folders" in w for w in why), why


def rewrite_commit(folder: Path, step: int, **changes: Any) -> CommitRecord:
    """The commit record of ``step`` in ``folder`` re-encoded with ``changes``
    (canonical, its components untouched, so they still verify)."""
    for p in (folder / "run" / "commits").iterdir():
        rec = CommitRecord.decode(p.read_bytes(), "a planted record")
        if rec.step == step:
            p.write_bytes(replace(rec, **changes).encode())
            return CommitRecord.decode(p.read_bytes(), "the planted record")
    raise AssertionError(f"no commit of step {step} in {folder}")


@pytest.mark.parametrize("what", ["identity", "run"])
def test_a_peer_copy_of_another_identity_or_run_is_not_held(job: Job, what: str) -> None:
    changes = {"identity_digest": "0" * 64} if what == "identity" else {"run_id": "other-run"}
    rewrite_commit(job.peer(0, 1), 3, **changes)
    shutil.copytree(job.peer(0, 1) / "run", job.peer(0, 1) / "other-run")  # a folder of another run beside it
    held, why = holdings(job, 0)
    assert {s: steps(h) for s, h in held.items()} == {1: [2, 1]}, held  # the newest two that are this run's
    assert any("step 3" in w for w in why), why


# ------------------------------------------------- other saves, zombies, damage
def test_a_peer_copy_with_another_manifest_than_the_owners_own_is_never_planned(job: Job) -> None:
    """Rank 0's copy of rank 1's step 3 carries other record bytes than rank
    0's own step 3 (it still verifies: same components): no save is held whole
    at step 3, so the plan is step 2 and never the mismatched copy."""
    forged = rewrite_commit(job.peer(0, 1), 3, created_at=job.refs[3].record.created_at + 1)
    held, _ = holdings(job, 0)
    assert [(h["step"], h["manifest_digest"]) for h in held[1]][0] == (3, forged.manifest_digest())
    shutil.rmtree(job.own(1))
    own0, _ = local_holdings(job.local, "run", 0, job.digest, AUTH)
    plan, everywhere, _ = plan_repair({0: own0, 1: []}, {0: held}, 2)
    assert plan is not None and plan.target == (2, 1, job.refs[2].save_id, job.refs[2].manifest_digest)
    assert plan.fetch == {1: 0} and everywhere == 2


def test_a_copy_that_differs_from_the_durable_commit_is_never_written_back(job: Job) -> None:
    rewrite_commit(job.peer(0, 1), 1, created_at=job.refs[1].record.created_at + 1)  # step 1 is durable
    shutil.rmtree(job.own(1))
    with pytest.raises(CkptStoreError):
        fetch(job, 1)
    assert commits(job.own(1)) == set()


def register_attempt_2(job: Job) -> None:
    """A second attempt resumes from the durable step 1 (rank 1 reported
    nothing): attempt 1's steps 2 and 3 are a zombie's from now on."""
    coord, member = open_pair(job.base, peers={1: {"held": [], "reasons": []}})
    assert coord.resumed_from is not None and coord.resumed_from.step == 1
    assert coord.attempt is not None and coord.attempt.number == 2
    coord.close()
    member.close()


@VERSION_2
def test_a_zombie_attempts_peer_copy_is_never_written_back(job: Job) -> None:
    register_attempt_2(job)
    shutil.rmtree(job.own(1))
    with pytest.raises(SupersededError):
        fetch(job, 3)
    assert commits(job.own(1)) == set()  # no commit: the owner holds nothing of the zombie's save
    held, _ = local_holdings(job.local, "run", 1, job.digest, AUTH)
    assert held == []


def test_a_zombie_attempts_peer_copy_is_not_reported_held(job: Job) -> None:
    register_attempt_2(job)
    for n in (job.base / "durable" / "run" / "attempts").iterdir():  # as the copy thread mirrors them
        shutil.copy(n, job.peer(0, 1) / "run" / "attempts" / n.name)
    held, _ = holdings(job, 0)
    assert [h["step"] for h in held.get(1, [])] == [1]


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flipped":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "truncated":
        path.write_bytes(data[:-7])
    else:
        path.write_bytes(data + b"more")


@VERSION_2
@pytest.mark.parametrize("how", ["flipped", "truncated", "oversized"])
def test_a_damaged_peer_copy_is_not_held_and_nothing_of_it_lands(job: Job, how: str) -> None:
    sid = job.refs[3].save_id
    damage(job.peer(0, 1) / "run" / "saves" / sid / "rank1" / "w", how)
    held, why = holdings(job, 0)
    assert {s: steps(h) for s, h in held.items()} == {1: [2, 1]}, held
    assert any("step 3" in w for w in why), why
    # asked for it anyway (the copy damaged after it was reported): zeros are sent, the owner's digest refuses them
    shutil.rmtree(job.own(1))
    with pytest.raises(CorruptionError, match="BLAKE3"):
        fetch(job, 3)
    assert commits(job.own(1)) == set() and save_files(job.own(1), sid) in ([], ["rank1"]), save_files(job.own(1), sid)


# ------------------------------------------------------------- lying frames
HEADER = pf._HEADER  # the frame header's layout, as a lying sender would pack it


def send_frame(end: End, dst: int, job: Job, sender: int, step: int, *, record: CommitRecord | None = None,
               data: bytes | None = None) -> None:
    """A frame of ``sender``'s part of ``step`` (its record, or ``record``; its bytes, or ``data``)."""
    rec = record or job.refs[step].record
    body = part(step, sender) if data is None else data

    def read(name: str, entry: Any) -> Iterator[bytes]:
        yield body

    pf.send_part(end, dst, step, rec.encode(), read, [f"rank{sender}/w"])


def raw_frame(job: Job, step: int) -> bytes:
    """The bytes of a sound frame of rank 1's part of ``step`` (header, record, component)."""
    wire = Wire()
    send_frame(wire.end(0), 1, job, 1, step)
    return wire.left(0, 1)


def lies(job: Job) -> dict[str, bytes]:
    rec = job.refs[3].record.encode()
    magic = pf._MAGIC
    other_run = replace(job.refs[3].record, run_id="other-run").encode()
    spaced = rec.replace(b'":', b'": ', 1)
    return {
        "bad magic": HEADER.pack(magic ^ 1, 1, 3, len(rec)) + rec,
        "bad status": HEADER.pack(magic, 7, 3, len(rec)) + rec,
        "record over the bound": HEADER.pack(magic, 1, 3, MAX_COMMIT_RECORD + 1),  # nothing follows: never waited for
        "record of another run": HEADER.pack(magic, 1, 3, len(other_run)) + other_run,
        "record not json": HEADER.pack(magic, 1, 3, 12) + b"not a record",
        "record not canonical": HEADER.pack(magic, 1, 3, len(spaced)) + spaced,
        "empty record": HEADER.pack(magic, 1, 3, 0),
        "short header": HEADER.pack(magic, 1, 3, len(rec))[:20],
        "short record": HEADER.pack(magic, 1, 3, len(rec)) + rec[:-1],
    }


@pytest.mark.parametrize("lie", [
    "bad magic", "bad status", "record over the bound", "record of another run", "record not json",
    "record not canonical", "empty record", "short header", "short record"])
def test_a_frame_that_lies_is_a_peer_copy_error_and_the_owner_writes_nothing(job: Job, lie: str) -> None:
    shutil.rmtree(job.own(1))
    wire = Wire()
    wire.end(0).send(1, lies(job)[lie])
    with pytest.raises(PeerCopyError):
        frame = receive_frame(wire.end(1), 0, 1, "run")
        if frame is not None:
            write_back(frame, job.local, 1, job.url, None, AUTH, job.digest, None)
    assert not job.own(1).exists()


@VERSION_2
def test_a_component_flipped_on_the_wire_never_lands(job: Job) -> None:
    shutil.rmtree(job.own(1))
    good = part(3, 1)
    wire = Wire()
    send_frame(wire.end(0), 1, job, 1, 3, data=good[:3000] + bytes([good[3000] ^ 4]) + good[3001:])
    frame = receive_frame(wire.end(1), 0, 1, "run")
    assert frame is not None
    with pytest.raises(CorruptionError, match="BLAKE3"):
        write_back(frame, job.local, 1, job.url, None, AUTH, job.digest, None)
    assert wire.left(0, 1) == b""  # in step for the next frame
    assert commits(job.own(1)) == set() and save_files(job.own(1), job.refs[3].save_id) in ([], ["rank1"])


@VERSION_2
def test_a_sender_that_stops_mid_component_leaves_nothing(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pf, "CHUNK", 1000)  # rank 1's part of 9,000 bytes is 9 chunks
    shutil.rmtree(job.own(1))
    whole = raw_frame(job, 3)
    wire = Wire()
    wire.end(0).send(1, whole[: len(whole) - 4500])
    frame = receive_frame(wire.end(1), 0, 1, "run")
    assert frame is not None
    with pytest.raises(PeerCopyError, match="did not answer"):
        write_back(frame, job.local, 1, job.url, None, AUTH, job.digest, None)
    assert commits(job.own(1)) == set()
    assert save_files(job.own(1), job.refs[3].save_id) in ([], ["rank1"]), save_files(job.own(1), job.refs[3].save_id)


@VERSION_2
def test_a_component_longer_than_its_record_says_puts_the_link_out_of_step(job: Job) -> None:
    """The receiver takes the sizes from the record, never from the sender: the
    surplus is not written; it is read as the next frame's header, which is
    refused (the caller stops using the link)."""
    shutil.rmtree(job.own(1))
    wire = Wire()
    wire.end(0).send(1, raw_frame(job, 3) + b"\x00" * 40)
    frame = receive_frame(wire.end(1), 0, 1, "run")
    assert frame is not None
    write_back(frame, job.local, 1, job.url, None, AUTH, job.digest, None)
    assert (job.own(1) / "run" / "saves" / job.refs[3].save_id / "rank1" / "w").read_bytes() == part(3, 1)
    with pytest.raises(PeerCopyError, match="not a peer-copy frame"):
        receive_frame(wire.end(1), 0, 1, "run")


@VERSION_2
def test_a_record_claiming_a_huge_component_costs_the_receiver_bounded_memory(job: Job) -> None:
    import tracemalloc

    rec = job.refs[3].record
    big = replace(rec, components={n: replace(c, size=2**44) for n, c in rec.components.items()}).encode()
    wire = Wire()
    wire.end(0).send(1, HEADER.pack(pf._MAGIC, 1, 3, len(big)) + big)
    tracemalloc.start()
    try:
        frame = receive_frame(wire.end(1), 0, 1, "run")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert frame is not None
    assert peak < 4 * 2**20, f"{peak} bytes to receive a header and a record of {len(big)} bytes"


# ------------------------------------------------ the copy thread's receiving side
def receiving(job: Job, wire: Wire, holder: int, senders: tuple[int, ...], keep: int = 5) -> pc.PeerCopies:
    """Rank ``holder``'s copy thread receiving from ``senders``, its peer folders
    opened as ``TieredStore`` opens them (records mirrored from the durable tier)."""
    from ckptstore.backends.local import LocalBackend
    from ckptstore.core.binding import read_run_record
    from ckptstore.core.bounded_io import RunIO
    from ckptstore.core.fencing import AttemptLog

    durable = RunIO(LocalBackend(job.base / "durable"), "run", None)
    run_record, _ = pr.read_durable_records(durable, 1)
    read_run_record(durable, None)  # the durable run record decides the naming
    attempts = AttemptLog(durable, AUTH)

    def folder(sender: int) -> Any:
        tier = pc.open_peer_folder(job.local, holder, sender, "run", attempts, job.digest, AUTH, None, job.url)
        tier.io.layout_or_none = durable.layout
        tier.mirror(run_record, attempts.load())
        return tier

    def read(ref: Any, name: str, entry: Any) -> Iterator[bytes]:
        raise AssertionError("this rank sends nothing")

    return pc.PeerCopies(wire.end(holder), {s: (holder,) for s in senders}, run_id="run", read=read, folder=folder,
                         keep=keep, record=lambda kind, payload: None)


def receives(copies: pc.PeerCopies, sender: int) -> Any:
    return next(p for p in copies.status() if p.role == "receives-from" and p.peer == sender)


def receive_once(job: Job, *, sent: int, acknowledged: int) -> tuple[pc.PeerCopies, Wire]:
    """Rank 0's copy thread receives one frame of rank 1's part of step ``sent``
    for the save of step ``acknowledged``; closed when it was handled."""
    wire = Wire()
    copies = receiving(job, wire, 0, (1,))
    send_frame(wire.end(1), 0, job, 1, sent)
    copies.submit(job.refs[acknowledged])
    assert copies.flush(10)
    copies.close()
    return copies, wire


@VERSION_2
@pytest.mark.parametrize("where", sorted(LINKED))
def test_the_copy_thread_writes_nothing_through_a_link_in_its_peer_folder(job: Job, tmp_path: Path,
                                                                           where: str) -> None:
    away, link = plant_link(job, tmp_path, where)  # in rank 0's folder, where rank 1's copies go
    before, own_before = snapshot(away), snapshot(job.own(0) / "run")
    copies, wire = receive_once(job, sent=3, acknowledged=3)
    st = receives(copies, 1)
    assert st.failures == 1 and st.copies == 0 and "symbolic link" in str(st.last_error), st
    assert copies.stopped is None and wire.left(1, 0) == b""  # the frame drained: the link stays in step
    assert snapshot(away) == before and snapshot(job.own(0) / "run") == own_before and link.is_symlink()


@VERSION_2
def test_the_copy_thread_keeps_only_the_save_acknowledged_here(job: Job) -> None:
    """A sender that sends another save's record (here step 2's, when step 3
    was acknowledged) is refused and its frame drained; the folder is unchanged."""
    before = snapshot(job.peer(0, 1))
    copies, wire = receive_once(job, sent=2, acknowledged=3)
    st = receives(copies, 1)
    assert st.failures == 1 and "not the save acknowledged here" in str(st.last_error), st
    assert wire.left(1, 0) == b"" and snapshot(job.peer(0, 1)) == before


@VERSION_2
def test_a_rank_that_is_not_a_pair_gets_nothing_accepted(job: Job) -> None:
    """Rank 2 (no pair of rank 0's) sends rank 0 a sound-looking frame of rank
    1's part: never received, no folder made for it, nothing of rank 0's
    changed; rank 1's own frame is kept as usual."""
    shutil.rmtree(job.peer(0, 1))
    own_before = snapshot(job.own(0) / "run")
    wire = Wire()
    copies = receiving(job, wire, 0, (1,))
    send_frame(wire.end(2), 0, job, 1, 3)
    send_frame(wire.end(1), 0, job, 1, 3)
    copies.submit(job.refs[3])
    assert copies.flush(10)
    copies.close()
    assert receives(copies, 1).copies == 1
    assert sorted(p.name for p in (job.own(0) / ".peers").iterdir()) == ["rank-1"]
    assert wire.left(2, 0) != b""  # rank 2's bytes were never read
    assert snapshot(job.own(0) / "run") == own_before


@VERSION_2
def test_peer_retention_deletes_nothing_outside_its_folder(job: Job, tmp_path: Path) -> None:
    """keep=1: the folder of rank 1's copies is trimmed to step 3; step 2's save
    folder there is a planted link to a user's folder (never followed), and the
    holder's own saves and the durable store are untouched."""
    away = tmp_path / "users"
    shutil.copytree(job.peer(0, 1) / "run" / "saves" / job.refs[2].save_id, away)
    sid2 = job.peer(0, 1) / "run" / "saves" / job.refs[2].save_id
    shutil.rmtree(sid2)
    sid2.symlink_to(away, target_is_directory=True)
    before, own_before, durable_before = snapshot(away), snapshot(job.own(0)), snapshot(job.base / "durable")
    wire = Wire()
    copies = receiving(job, wire, 0, (1,), keep=1)
    send_frame(wire.end(1), 0, job, 1, 3)
    copies.submit(job.refs[3])
    assert copies.flush(10)
    copies.close()
    assert receives(copies, 1).copies == 1, copies.status()
    assert snapshot(away) == before
    assert {k: v for k, v in snapshot(job.own(0)).items() if not k.startswith(".peers")} == \
        {k: v for k, v in own_before.items() if not k.startswith(".peers")}
    assert snapshot(job.base / "durable") == durable_before
    left = save_files(job.peer(0, 1), job.refs[1].save_id)
    assert left == [], left  # retention did run there: step 1's copy is gone
    assert save_files(job.peer(0, 1), job.refs[3].save_id) == ["rank1", "rank1/w"]
