"""Peer copies of a version-3 part (pieces) are input too (protocol_spec/THREATS.md
§4.16, "Pieces"): a frame of pieces is answered by its receiver with what it
needs, so both ends now read what the other sends — the need reply as much
as the objects.

A two-rank version-3 job (coordinator and member on one durable directory,
local tiers) saves steps 1-3; each rank's part is ``rank<r>/w`` (new at each
step) and ``rank<r>/frozen`` (the same bytes: one piece reused by every
save). Each rank folder is copied into the other's ``.peers`` folder, as the
copy thread leaves it. The link is :class:`Wire`; the ends of a frame of
pieces run in two threads, as on two ranks."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from ckptstore import CheckpointStore, OpenOptions, PieceTiming, TierOptions
from ckptstore.backends.local import LocalBackend
from ckptstore.core.bounded_io import RunIO
from ckptstore.core.record_auth import RecordAuth
from ckptstore.errors import CorruptionError, SaveAbortedError, StoreUnavailableError
from ckptstore.protocol import ComponentEntry
from ckptstore.tiers import PeerCopyError, local_holdings, peer_holdings, receive_frame, send_held_part, write_back
from ckptstore.tiers import peer_copies as pc
from ckptstore.tiers import peer_frames as pf
from ckptstore.tiers import peer_repair as pr
from tests.peer_wire import Wire

IDENT = {"model": "tiny-v3", "world_size": 2}
AUTH = RecordAuth("off", None)
FROZEN = {r: os.urandom(1_200_000 + r) for r in (0, 1)}  # at least 1 MiB: a piece of its own


def part(step: int, rank: int) -> bytes:
    return bytes((step * 31 + rank * 7 + i) % 251 + 1 for i in range(5000 + 2000 * rank))


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


def commits(folder: Path) -> list[str]:
    d = folder / "run" / "commits"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def frozen_key(job: Job, rank: int) -> str:
    (p,) = job.refs[3].record.components[f"rank{rank}/frozen"].pieces
    return f"run/pieces/{p.holder}/{p.digest}"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Job:
    base = tmp_path_factory.mktemp("peerpieces")
    tiers = TierOptions(base / "local", close_flush_seconds=0.5, replicate_every=10, keep=5)
    o = OpenOptions(protocol_version=3, pieces=PieceTiming(window=0.05))
    coord = CheckpointStore.open(str(base / "durable"), "run", identity=IDENT, options=replace(
        o, single_writer=True, tiers=replace(tiers, rank=0, peers={})))
    assert coord.attempt is not None
    member = CheckpointStore.open(str(base / "durable"), "run", identity=IDENT, join_attempt=coord.attempt.number,
                                  options=replace(o, tiers=replace(tiers, rank=1)))
    refs = {}
    for step in (1, 2, 3):
        sid = coord.new_save_id(step)
        a, b = coord.stage(step, save_id=sid), member.stage(step, save_id=sid)
        comps = [a.put("rank0/w", part(step, 0)), a.put("rank0/frozen", FROZEN[0]),
                 b.put("rank1/w", part(step, 1)), b.put("rank1/frozen", FROZEN[1])]
        ref = coord.publish(step, sid, {c.name: c for c in comps}, ranks={0: ["rank0/w", "rank0/frozen"],
                                                                           1: ["rank1/w", "rank1/frozen"]},
                            world_size=2)
        member.publish_record(ref.record.encode())
        refs[step] = ref
    assert coord.flush(10) and member.flush(10)
    job = Job(base, coord.identity_digest, refs)
    coord.close()
    member.close()
    for holder, sender in ((0, 1), (1, 0)):
        shutil.copytree(job.own(sender) / "run", job.peer(holder, sender) / "run")
    # every save reuses the frozen piece the first one wrote
    holders = {refs[s].record.components["rank1/frozen"].pieces[0].holder for s in (1, 2, 3)}  # type: ignore[index]
    assert holders == {refs[1].save_id}
    return job


@pytest.fixture
def job(made: Job, tmp_path: Path) -> Job:
    shutil.copytree(made.base, tmp_path / "job", symlinks=True)
    return Job(tmp_path / "job", made.digest, made.refs)


def reader(folder: Path, label: str) -> Callable[[str, ComponentEntry], Iterator[bytes]]:
    io = RunIO(LocalBackend(folder), "run", None)
    return lambda key, entry: io.verified_chunks(key, entry, f"{label} {key}")


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` on another thread (the other rank); the returned call joins it and gives its result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> Any:
        t.join(30)
        assert not t.is_alive()
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return join


def fetch(job: Job, step: int, *, holder: int = 0, owner: int = 1) -> tuple[Any, list[str]]:
    """The write-back of ``owner``'s part of ``step`` from ``holder``'s peer folder (two threads); the
    frame is consumed whole both ways, whatever happened."""
    wire = Wire(wait=10)
    sent = in_thread(lambda: send_held_part(wire.end(holder), owner, job.local, holder, owner, "run", step, 1,
                                            job.digest, AUTH))
    try:
        frame = receive_frame(wire.end(owner), holder, owner, "run")
        assert frame is not None
        ref = write_back(frame, job.local, owner, job.url, None, AUTH, job.digest, None)
    except BaseException:
        with contextlib.suppress(BaseException):
            sent()
        assert wire.left(holder, owner) == b"" and wire.left(owner, holder) == b""
        raise
    failed = sent()
    assert wire.left(holder, owner) == b"" and wire.left(owner, holder) == b""
    return ref, failed


# ------------------------------------------------------------------ baseline
def test_a_pieced_copy_is_held_and_written_back_bit_for_bit(job: Job) -> None:
    held, why = peer_holdings(job.local, "run", 0, job.digest, AUTH)
    assert [h["step"] for h in held[1]][:2] == [3, 2] and not why, why
    shutil.rmtree(job.own(1))  # node b's disk is lost
    ref, failed = fetch(job, 3)
    assert not failed and ref.manifest_digest == job.refs[3].manifest_digest
    back, why = local_holdings(job.local, "run", 1, job.digest, AUTH)
    assert [h["step"] for h in back] == [3], why
    assert (job.own(1) / frozen_key(job, 1)).read_bytes() == FROZEN[1]


# ------------------------------------------------ the copy thread asks for what it lacks
def receiving(job: Job, wire: Wire, keep: int = 5) -> pc.PeerCopies:
    """Rank 0's copy thread receiving rank 1's parts, its peer folder opened as the tiers open it."""
    from ckptstore.backends.local import LocalBackend as LB
    from ckptstore.core.binding import read_run_record
    from ckptstore.core.fencing import AttemptLog

    durable = RunIO(LB(job.base / "durable"), "run", None)
    run_record, _ = pr.read_durable_records(durable, 1)
    read_run_record(durable, None)
    attempts = AttemptLog(durable, AUTH)

    def folder(sender: int) -> Any:
        tier = pc.open_peer_folder(job.local, 0, sender, "run", attempts, job.digest, AUTH, None, job.url)
        tier.io.layout_or_none = durable.layout
        tier.mirror(run_record, attempts.load())
        return tier

    def read(key: str, entry: Any) -> Iterator[bytes]:
        raise AssertionError("this rank sends nothing")

    return pc.PeerCopies(wire.end(0), {1: (0,)}, run_id="run", read=read, folder=folder, keep=keep,
                         record=lambda kind, payload: None)


def copy_steps(job: Job, copies: pc.PeerCopies, wire: Wire, steps: list[int]) -> list[pf.Sent]:
    """Rank 1 sends its part of each of ``steps`` from its own folder; rank 0's thread receives them."""
    out = []
    for step in steps:
        copies.submit(job.refs[step])
        out.append(pf.send_part(wire.end(1), 0, step, job.refs[step].record.encode(),
                                reader(job.own(1), "rank 1's"), ["rank1/frozen", "rank1/w"]))
        assert copies.flush(10)
    return out


def received(copies: pc.PeerCopies) -> Any:
    return next(p for p in copies.status() if p.role == "receives-from")


def test_the_frozen_piece_crosses_the_link_once(job: Job) -> None:
    shutil.rmtree(job.peer(0, 1))
    wire = Wire(wait=10)
    copies = receiving(job, wire)
    sent = copy_steps(job, copies, wire, [1, 2, 3])
    copies.close()
    assert [s.nbytes for s in sent] == [len(FROZEN[1]) + len(part(1, 1)), len(part(2, 1)), len(part(3, 1))]
    assert received(copies).copies == 3 and received(copies).failures == 0
    assert (job.own(0) / ".peers" / "rank-1" / frozen_key(job, 1)).read_bytes() == FROZEN[1]
    held, why = peer_holdings(job.local, "run", 0, job.digest, AUTH)
    assert [h["step"] for h in held[1]][:1] == [3], why


def test_a_held_piece_changed_since_it_landed_is_asked_for_again(job: Job) -> None:
    """Bit rot under the holder (same size, its listing changed): the next copy
    re-hashes it before relying on it, finds it damaged and asks for it."""
    shutil.rmtree(job.peer(0, 1))
    wire = Wire(wait=10)
    copies = receiving(job, wire)
    copy_steps(job, copies, wire, [1])
    path = job.own(0) / ".peers" / "rank-1" / frozen_key(job, 1)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x10
    path.write_bytes(bytes(data))
    (sent,) = copy_steps(job, copies, wire, [2])
    copies.close()
    assert sent.nbytes == len(FROZEN[1]) + len(part(2, 1))  # asked for again
    assert path.read_bytes() == FROZEN[1]  # repaired in place
    assert received(copies).copies == 2 and received(copies).failures == 0


def test_a_planted_piece_in_the_peer_folder_is_never_trusted(job: Job) -> None:
    """A piece the holder did not land in this process (planted, or left by an
    earlier process) is asked for: the right size and name prove nothing."""
    shutil.rmtree(job.peer(0, 1))
    planted = job.own(0) / ".peers" / "rank-1" / frozen_key(job, 1)
    planted.parent.mkdir(parents=True)
    planted.write_bytes(bytes(len(FROZEN[1])))
    wire = Wire(wait=10)
    copies = receiving(job, wire)
    (sent,) = copy_steps(job, copies, wire, [3])
    copies.close()
    assert sent.nbytes == len(FROZEN[1]) + len(part(3, 1)) and planted.read_bytes() == FROZEN[1]


# ------------------------------------------------------------- lying replies and frames
def answer(job: Job, reply: bytes, step: int = 3) -> tuple[Any, bytes]:
    """Rank 1 sends its part of ``step`` to a rank 0 that answers with ``reply``; (its error or result, what
    it sent after the record)."""
    wire = Wire(wait=0.5)
    rec = job.refs[step].record.encode()
    wire.end(0).send(1, reply)
    try:
        got: Any = pf.send_part(wire.end(1), 0, step, rec, reader(job.own(1), "rank 1's"), ["rank1/frozen", "rank1/w"])
    except PeerCopyError as exc:
        got = exc
    after = wire.left(1, 0)[pf._HEADER.size + len(rec):]
    return got, after


REPLY = pf._REPLY


@pytest.mark.parametrize("lie", ["bad magic", "bad status", "wrong count", "not a bit", "refused with a count",
                                 "short", "nothing"])
def test_a_reply_that_lies_puts_the_link_out_of_step_and_sends_nothing(job: Job, lie: str) -> None:
    magic = pf._REPLY_MAGIC
    replies = {
        "bad magic": REPLY.pack(magic ^ 1, 1, 2) + b"\x01\x01",
        "bad status": REPLY.pack(magic, 9, 2) + b"\x01\x01",
        "wrong count": REPLY.pack(magic, 1, 3) + b"\x01\x01\x01",
        "not a bit": REPLY.pack(magic, 1, 2) + b"\x01\x02",
        "refused with a count": REPLY.pack(magic, 0, 2),
        "short": REPLY.pack(magic, 1, 2) + b"\x01",
        "nothing": b"",
    }
    got, after = answer(job, replies[lie])
    assert isinstance(got, PeerCopyError), got
    assert after == b""  # not one byte of the part went out


def test_a_refusal_costs_the_record_alone(job: Job) -> None:
    got, after = answer(job, REPLY.pack(pf._REPLY_MAGIC, 0, 0))
    assert isinstance(got, pf.Sent) and got.refused and got.nbytes == 0 and after == b""


def test_a_receiver_that_holds_less_than_it_said_commits_nothing(job: Job) -> None:
    """A need reply that skips a piece the folder does not hold (a lying or
    mistaken holder): the part is received, then the presence check refuses
    the commit."""
    shutil.rmtree(job.own(1))
    wire = Wire(wait=10)
    sent = in_thread(lambda: send_held_part(wire.end(0), 1, job.local, 0, 1, "run", 3, 1, job.digest, AUTH))
    frame = receive_frame(wire.end(1), 0, 1, "run")
    assert frame is not None and frame.pieced
    durable = RunIO(LocalBackend(job.base / "durable"), "run", None)
    from ckptstore.core.binding import read_run_record
    from ckptstore.core.fencing import AttemptLog
    from ckptstore.tiers.local import LocalTier

    read_run_record(durable, None)
    attempts = AttemptLog(durable, AUTH)
    tier = LocalTier(job.local, "run", attempts, job.digest, AUTH, None, part=1, durable_url=job.url)
    tier.io.layout_or_none = durable.layout
    run_record, _ = pr.read_durable_records(durable, 1)
    tier.mirror(run_record, attempts.load())
    with pytest.raises(SaveAbortedError, match="missing"):
        pf.receive_part(frame, tier, lambda objs: [o.piece is None or "frozen" not in o.label for o in objs])
    assert sent() == []
    assert commits(job.own(1)) == []
    assert wire.left(0, 1) == b""


def test_a_piece_flipped_on_the_wire_never_lands(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.rmtree(job.own(1))
    good = reader(job.peer(0, 1), "held")

    def flipping(key: str, entry: ComponentEntry) -> Iterator[bytes]:
        for block in good(key, entry):
            yield bytes([block[0] ^ 1]) + bytes(block[1:]) if "pieces" in key and len(block) > 100_000 else block

    wire = Wire(wait=10)
    rec = job.refs[3].record.encode()
    sent = in_thread(lambda: pf.send_part(wire.end(0), 1, 3, rec, flipping, ["rank1/frozen", "rank1/w"]))
    frame = receive_frame(wire.end(1), 0, 1, "run")
    assert frame is not None
    with pytest.raises(CorruptionError, match="BLAKE3"):
        write_back(frame, job.local, 1, job.url, None, AUTH, job.digest, None)
    assert sent().failed == []
    assert not (job.own(1) / frozen_key(job, 1)).exists()
    assert commits(job.own(1)) == []
    assert wire.left(0, 1) == b""


def test_a_write_back_never_writes_through_a_link_in_the_owners_pieces(job: Job, tmp_path: Path) -> None:
    away = tmp_path / "users"
    away.mkdir()
    holder = job.refs[1].save_id
    pieces = job.own(1) / "run" / "pieces"
    shutil.rmtree(pieces / holder)
    (pieces / holder).symlink_to(away, target_is_directory=True)
    for c in (job.own(1) / "run" / "commits").iterdir():
        c.unlink()  # rank 1 lost its commits: the save is written back
    with pytest.raises(StoreUnavailableError, match="link"):
        fetch(job, 3)
    assert list(away.iterdir()) == [] and (pieces / holder).is_symlink()
